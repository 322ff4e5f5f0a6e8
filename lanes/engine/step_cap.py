"""How large a step may be while the device is short of memory: halved on each out-of-memory error,
restored step by step after clean ones.

A CUDA out-of-memory error inside a step is not a dead device (lanes/device/fault.py): the step's
activations did not fit next to what the pools, the graphs and other processes hold. The engine frees
what the step held, recomputes the step's requests, and runs its next steps smaller: fewer decode
rows and fewer prefill tokens per forward, down to one row and one KV block. A request that still
runs out of memory at that size `max_attempts` times fails with a clean error, so that one request
the device cannot hold never loops.
"""

from dataclasses import dataclass

import torch

RESTORE_AFTER_STEPS = 32  # clean steps before a halved cap doubles again


def is_oom(exc: BaseException) -> bool:
    """A device allocation failed (torch.cuda.OutOfMemoryError is torch.OutOfMemoryError)."""
    return isinstance(exc, torch.OutOfMemoryError)


def free_cached_memory(device: torch.device) -> None:
    """Give the allocator's cached blocks back after an out-of-memory error, so that the smaller retry
    (and other processes on the GPU) can use what the failed step had reserved."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class StepCap:
    max_rows: int  # decode rows per step when memory is not short (max_num_seqs)
    max_prefill_tokens: int  # prefill tokens per forward when memory is not short (idle_prefill_tokens)
    min_prefill_tokens: int  # one KV block
    rows: int = 0
    prefill_tokens: int = 0
    clean_steps: int = 0
    num_oom_recoveries: int = 0  # out-of-memory errors recovered from (the step's requests recomputed)

    def __post_init__(self):
        self.rows, self.prefill_tokens = self.max_rows, self.max_prefill_tokens

    def at_min(self, prefill: bool) -> bool:
        """Whether a step of this kind is as small as it can be made."""
        return self.prefill_tokens <= self.min_prefill_tokens if prefill else self.rows <= 1

    def shrink(self, failed_rows: int | None = None) -> None:
        """After an out-of-memory error: halve both caps (the rows from those of the failed decode step)."""
        self.num_oom_recoveries += 1
        self.clean_steps = 0
        self.rows = max(1, min(self.rows, failed_rows or self.rows) // 2)
        self.prefill_tokens = max(self.min_prefill_tokens, self.prefill_tokens // 2)

    def observe_clean_step(self) -> None:
        """After a step without an out-of-memory error: double a halved cap every RESTORE_AFTER_STEPS."""
        if self.rows == self.max_rows and self.prefill_tokens == self.max_prefill_tokens:
            return
        self.clean_steps += 1
        if self.clean_steps >= RESTORE_AFTER_STEPS:
            self.clean_steps = 0
            self.rows = min(self.max_rows, self.rows * 2)
            self.prefill_tokens = min(self.max_prefill_tokens, self.prefill_tokens * 2)
