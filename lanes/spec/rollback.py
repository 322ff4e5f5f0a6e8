"""The one place where KV lengths shrink after verification.

Each model wrote KV for every token it was fed, drafts included. After the target accepts k of the
n drafts, the committed sequence is the T tokens that existed before this step plus the k accepted
drafts (the recovered or bonus token that follows has not been fed to either model yet). So a
model's cache stays valid up to T + k tokens and no further:
  target: fed the last token and all n drafts -> wrote T + n, keeps T + k;
  draft:  fed up to draft n - 1              -> wrote T + n - 1, keeps T + min(k, n - 1);
  a model fed nothing this step keeps what it had.
Positions past the new length are left as they are; the next write overwrites them and the mask
hides them until then. Whole blocks past the new length hold only rejected tokens, and they stay
with the slot: the next step writes the same positions again (vLLM keeps its lookahead slots the same
way), so a row holds at most the blocks of its length plus one draft (two after a step launched ahead,
lanes/engine/core.py EngineCore._launch_next). Giving them back at every
rejection and taking them again the next step was host work on the critical path: in gpu_check.py's
7B verify step at 64 rows, where every row crosses a block each step, 14.34 against 13.73 ms on an
H200 (benchmarks/results/gpu_evidence_h200/step_paged_ae6a372, step_paged_dc80e56). They go back with the
slot, when the sequence ends or is preempted. (HF's DynamicCache is mutated in place by forward passes, so
rolling back by copying caches would not be safe; lengths over a fixed pool are.)
"""

import numpy as np

from lanes.kv.pool import KVPool


def rollback_after_verify(pool: KVPool, slots: list[int], num_tokens_before, num_accepted) -> None:
    """Every row of a verified batch at once: `slots` [B], T [B] and k [B] (lists or arrays)."""
    pool.lengths[slots] = np.minimum(pool.lengths[slots], np.add(num_tokens_before, num_accepted))
