"""How the decode engine reaches the other lanes: the remote proxies (`RemoteVerifier`,
`RemotePrefiller`, `LinkedVerifier`), the replica's calls on its engine's behalf, pdv's direct verify
channel, pdv's short prompts prefilled by a verify replica, and the step channel that carries a decode
replica's chunks of all requests to each ingress replica in one message a step (`stream_channel: step`).
"""
