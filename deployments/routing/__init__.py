"""Which replica a call between lanes reaches, and what happens when none answers: a verify replica's
lease and the request router that routes by it, Serve request ids of our own for calls made inside a
request, hedged calls, the router's state for the log of a stuck call, and the owners of the verify
lane's slots (freed when their decode replica dies).
"""
