"""The paged KV cache: the pool of blocks and its block tables, the block allocator, the prefix cache,
and how many blocks a lane gets.
"""
