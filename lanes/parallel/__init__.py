"""Tensor parallelism: sharding a Llama-family model over a group, the forwards rank 0 sends its
workers, the workers, and KV hand-over into and out of a sharded pool.
"""
