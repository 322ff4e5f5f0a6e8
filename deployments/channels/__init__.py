"""How the decode engine reaches the other lanes: the remote proxies (`RemoteVerifier`,
`RemotePrefiller`, `LinkedVerifier`), the replica's calls on its engine's behalf, pdv's direct verify
channel, and pdv's short prompts prefilled by a verify replica.
"""
