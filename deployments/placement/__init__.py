"""Where a lane replica runs: the GPUs it sees (its own first, its node's others with `kv_peer_access`;
MPS priority and SM share), its `Placement`, and the KV hand-over chosen from two placements (in place
by CUDA IPC, a peer copy, or through the host).
"""
