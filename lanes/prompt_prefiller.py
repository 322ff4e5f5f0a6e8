"""Prefill of whole prompts for a prefill lane that runs apart from the decode and verify lanes.

Prompts are prefilled in batches into this lane's own scratch slots; each request's KV is then
handed out as a view of its slot, which the deployment copies into the destination pools (a device
copy into a CUDA IPC view on the same GPU or a peer GPU, or through Ray's object store elsewhere)
before it releases the slots.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from lanes.grammar import FirstTokenMask
from lanes.model_runner import ModelRunner
from lanes.params import SamplingParams
from lanes.prefill import PrefillLane, plan_whole_prompts
from lanes.sequence import Sequence


@dataclass
class PrefillRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    token_bitmask: torch.Tensor | None = None  # structured output: the first token's [ceil(V / 32)] int32


@dataclass
class PrefilledKV:
    first_token: int
    target_kv: torch.Tensor  # [2, layers, kv_heads, prompt_len, head_dim]
    draft_kv: torch.Tensor | None


class PromptPrefiller:
    def __init__(self, target: ModelRunner, draft: ModelRunner | None, chunk_tokens: int):
        self.target = target  # runners over this lane's own scratch pools
        self.draft = draft
        self.chunk_tokens = chunk_tokens

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefilledKV]:
        """Prefill into scratch slots, copy each request's KV out, free the slots."""
        kvs, release = self.prefill_in_scratch(requests)
        try:
            return [PrefilledKV(kv.first_token, kv.target_kv.clone(),
                                kv.draft_kv.clone() if kv.draft_kv is not None else None) for kv in kvs]
        finally:
            release()

    def prefill_in_scratch(self, requests: list[PrefillRequest]) -> tuple[list[PrefilledKV], Callable[[], None]]:
        """Prefill into scratch slots; the KV returned are views of them, valid until `release()`.

        Writing from the views into the owners' pools saves a copy of every prompt's KV, and the
        variable-size temporaries that fragmented the lane's memory on the GPU.
        """
        t_slots = [self.target.pool.allocate() for _ in requests]
        d_slots = [self.draft.pool.allocate() for _ in requests] if self.draft else [None] * len(requests)

        def release() -> None:
            for t, d in zip(t_slots, d_slots):
                self.target.pool.free(t)
                if d is not None:
                    self.draft.pool.free(d)

        try:
            first = self._run(requests, self.target, self.draft, t_slots, d_slots)
        except BaseException:
            release()
            raise
        return [PrefilledKV(tok, self.target.pool.read_slot(t), self.draft.pool.read_slot(d) if self.draft else None)
                for tok, t, d in zip(first, t_slots, d_slots)], release

    def _run(self, requests, target: ModelRunner, draft: ModelRunner | None, t_slots, d_slots) -> list[int]:
        seqs = [Sequence(r.request_id, r.prompt_ids, r.params, r.seed, 0, target_slot=t, draft_slot=d,
                         grammar=None if r.token_bitmask is None else FirstTokenMask(r.token_bitmask))
                for r, t, d in zip(requests, t_slots, d_slots)]
        lane = PrefillLane(target, draft)
        first: dict[str, int] = {}
        while len(first) < len(seqs):
            chunks = plan_whole_prompts([s for s in seqs if s.request_id not in first], self.chunk_tokens)
            tokens = lane.run(chunks)[:, 0].cpu().tolist()  # logprobs are not served here: none packed
            for chunk, token in zip(chunks, tokens):
                chunk.seq.num_prefilled += chunk.length
                if chunk.completes_prompt:
                    first[chunk.seq.request_id] = token
        return [first[s.request_id] for s in seqs]
