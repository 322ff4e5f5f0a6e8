"""How many KV blocks a lane's pools get: from the device's free memory on CUDA (as vLLM sizes its
cache), else from the config.

Every pool of one engine (target and draft) gets the same number of blocks: they hold the same
sequences, token for token, so neither could use more than the other.
"""

import torch

from lanes.kv.pool import PoolShape


def num_kv_blocks(shapes: list[PoolShape], dtypes: list[torch.dtype], device: torch.device, num_slots: int,
                  explicit: int | None, gpu_memory_utilization: float) -> int:
    """Blocks per pool. `explicit` wins; on the CPU the default is every slot at full capacity (what
    the unpaged pools reserved). On CUDA: what is left of `gpu_memory_utilization` of the device's
    memory after this process's own allocations (the models), capped by the memory free now (other
    processes on the GPU) and by every slot at full capacity (more could never be used)."""
    per_slot = shapes[0].blocks_per_slot
    full = num_slots * per_slot
    if explicit is not None:
        blocks = explicit
    elif device.type != "cuda":
        blocks = full
    else:
        free, total = torch.cuda.mem_get_info(device)
        budget = min(free, int(total * gpu_memory_utilization) - torch.cuda.memory_reserved(device))
        block_bytes = sum(s.block_elements * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dtypes))
        blocks = min(full, max(0, budget) // block_bytes - 1)  # one pad block per pool
    if blocks < per_slot:
        raise ValueError(f"{blocks} KV blocks cannot hold one sequence of max_model_len ({per_slot} blocks of "
                         f"{shapes[0].block_size} tokens): raise gpu_memory_utilization or num_kv_blocks, or "
                         "lower max_model_len")
    return blocks
