"""How many KV blocks a lane's pools get: on CUDA from a measured memory profile of the lane's own
process, as vLLM's profile run sizes its cache; elsewhere from the config.

The lane's budget is `gpu_memory_utilization` of the device's memory (the factories have already
multiplied it by the lane's GPU share). From it come, in this order:
- what this process holds before its pools: the weights (and fused copies of them);
- the peak activations of its largest forwards, run once over a one-sequence pool before the real
  pools exist (`profile_activations`): a prefill chunk of `idle_prefill_tokens` with every
  position's logits, a decode/verify forward of `max_num_seqs` rows of `max_draft_len + 1` tokens,
  the draft's catch-up chunk; plus the float32 logits copies its sampling holds;
- what the CUDA graphs captured after sizing will hold: every graph's output buffer (they stay
  allocated in the graphs' memory pools) and one forward's activations per pool;
- the CUDA context and library workspaces, which live outside torch's allocator.
The pools get the rest, capped at every slot full. A lane never sizes from the memory free at the
time: lanes that start together on one GPU would race for it. Free memory is only checked, so that a
GPU whose other processes hold more than their shares fails the lane at once with its figures.

Every pool of one engine (target and draft) gets the same number of blocks: they hold the same
sequences, token for token, so neither could use more than the other.
"""

import logging
import time
from dataclasses import dataclass

import torch

from lanes.kv.pool import PoolShape

log = logging.getLogger(__name__)

GIB = 1 << 30
# The CUDA context, cuBLAS and Triton workspaces of one process: outside torch's allocator, so no
# profile of torch's sees them. An allowance, not a measurement: on a GPU shared by several processes
# the driver's figures cannot tell this process's part.
NON_TORCH_BYTES = 1 * GIB
# float32 [rows, L + 1, vocab] copies that sampling and rejection hold beside a verify forward's
# logits (probabilities of target and draft); the forward's own logits are in the profile.
SAMPLING_LOGITS_COPIES = 2
FREE_WAIT_S = 30.0  # how long a lane waits for the memory its plan needs to be free


class KVMemoryError(ValueError):
    """A lane's pools cannot hold one sequence of max_model_len in its memory budget (a deploy-time
    error: the replica fails to start, with the figures and the knob in one line)."""


@dataclass(frozen=True)
class MemoryPlan:
    """Where a lane's memory budget goes, in bytes (one process, one device)."""

    lane: str
    total_bytes: int  # the device's memory
    budget_bytes: int  # gpu_memory_utilization x the lane's share x total
    held_bytes: int  # what this process's allocator holds before the pools: weights, fused copies
    activation_bytes: int  # measured peak of the largest forwards, plus sampling's logits copies
    graph_bytes: int  # what the CUDA graphs captured after sizing will hold (estimated)
    block_bytes: int  # one block in every pool of this engine
    blocks_per_seq: int  # one sequence of max_model_len (the slot's capacity)
    block_size: int  # tokens per block
    slack_tokens: int  # a slot's room past max_model_len (a draft or catch-up chunk's padded writes)
    max_blocks: int  # every slot at full capacity: more could never be used
    non_torch_bytes: int = NON_TORCH_BYTES
    # The prefill lane copies each prompt's KV out of its blocks for the hand-over, a batch at once
    # (lanes/spec/prompt_prefiller.py), and a batch fills at most its pools: the copies need as much again.
    copied_out: bool = False

    @property
    def kv_bytes(self) -> int:
        return self.budget_bytes - self.held_bytes - self.activation_bytes - self.graph_bytes - self.non_torch_bytes

    @property
    def _fitting_blocks(self) -> int:
        per_block = self.block_bytes * (2 if self.copied_out else 1)
        return max(0, self.kv_bytes // per_block - 1)  # one pad block per pool

    @property
    def num_blocks(self) -> int:
        return min(self.max_blocks, self._fitting_blocks)

    def longest_context_tokens(self) -> int:
        """The longest max_model_len whose one sequence (plus the slot's slack) these pools would hold."""
        return self._fitting_blocks * self.block_size - self.slack_tokens

    def describe(self) -> str:
        return (f"{self.lane}: budget {_gib(self.budget_bytes)} of {_gib(self.total_bytes)} = weights "
                f"{_gib(self.held_bytes)} + activations {_gib(self.activation_bytes)} + CUDA graphs "
                f"{_gib(self.graph_bytes)} + CUDA context {_gib(self.non_torch_bytes)} + KV "
                f"{_gib(self.num_blocks * self.block_bytes)} ({self.num_blocks} blocks, "
                f"{self.num_blocks // self.blocks_per_seq} sequences of max_model_len)")

    def refusal(self) -> str:
        copies = " (and as much again for its hand-over copy)" if self.copied_out else ""
        return (f"{self.lane}: one sequence of max_model_len needs {_gib((self.blocks_per_seq + 1) * self.block_bytes)}"
                f" of KV{copies}, but {_gib(max(0, self.kv_bytes))} is left of the lane's budget of "
                f"{_gib(self.budget_bytes)} (weights {_gib(self.held_bytes)}, activations "
                f"{_gib(self.activation_bytes)}, CUDA graphs {_gib(self.graph_bytes)}, CUDA context "
                f"{_gib(self.non_torch_bytes)}): raise the lane's num_gpus or engine.gpu_memory_utilization, "
                f"or lower engine.max_model_len, max_num_seqs or idle_prefill_tokens{self._fit_note()}")

    def _fit_note(self) -> str:
        fitted = self.longest_context_tokens()
        return f" (max_model_len {fitted} would fit)" if fitted >= self.block_size else ""


def num_kv_blocks(shapes: list[PoolShape], dtypes: list[torch.dtype], device: torch.device, num_slots: int,
                  explicit: int | None, plan: MemoryPlan | None = None) -> int:
    """Blocks per pool. `explicit` wins; on CUDA the `plan`'s (from the lane's profile); elsewhere
    every slot at full capacity (what unpaged pools reserved)."""
    per_slot = shapes[0].blocks_per_slot
    if explicit is not None:
        blocks = explicit
    elif plan is not None:
        if plan.num_blocks < per_slot:
            raise KVMemoryError(plan.refusal())
        _wait_free(plan, device, held_blocks=per_slot)  # the profile's one-sequence pools (lanes/engine/core.py)
        log.info("%s", plan.describe())
        return plan.num_blocks
    else:
        blocks = num_slots * per_slot
    if blocks < per_slot:
        raise KVMemoryError(f"{blocks} KV blocks cannot hold one sequence of max_model_len ({per_slot} blocks of "
                            f"{shapes[0].block_size} tokens): raise num_kv_blocks or lower max_model_len")
    return blocks


def check_free(plan: MemoryPlan, free: int, device: str = "the GPU", held_blocks: int = 0) -> None:
    """The pools and graphs must fit the memory `free` now; if they do not, another process on this
    GPU holds more than its share (or a process that died has not given its memory back yet).
    `held_blocks`: blocks per pool this process holds already and gives back before the pools grow
    (the one-sequence pools the profile ran over, as large as 16 GiB for a 7B model at 32k tokens)."""
    needed = (plan.num_blocks - held_blocks) * plan.block_bytes + plan.graph_bytes
    if needed > free:
        raise KVMemoryError(
            f"{plan.lane}: its KV pools and CUDA graphs need {_gib(needed)} but {device} has {_gib(free)} free: "
            f"other processes on it hold more than the rest of its memory; lower their num_gpus or "
            f"gpu_memory_utilization, or this lane's")


def _wait_free(plan: MemoryPlan, device: torch.device, held_blocks: int) -> None:
    """`check_free`, waiting up to FREE_WAIT_S for memory that a killed process of the lane being
    replaced has not given back yet (the driver frees it once the process is gone)."""
    deadline_s = time.monotonic() + FREE_WAIT_S
    while True:
        try:
            return check_free(plan, torch.cuda.mem_get_info(device)[0], str(device), held_blocks)
        except KVMemoryError:
            if time.monotonic() > deadline_s:
                raise
            time.sleep(1.0)


def block_bytes(shapes: list[PoolShape], dtypes: list[torch.dtype]) -> int:
    return sum(s.block_elements * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dtypes))


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"
