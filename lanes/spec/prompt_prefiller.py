"""Prefill of whole prompts for a prefill lane that runs apart from the decode and verify lanes.

Prompts are prefilled in batches into this lane's own scratch slots; each request's KV is then
gathered from its blocks, and the deployment copies it into blocks of the destination pools (a
device copy into a CUDA IPC view on the same GPU or a peer GPU, or through Ray's object store
elsewhere) before it releases the slots.

The scratch pools double as this lane's prefix cache (lanes/kv/prefix_cache.py): released blocks keep
their KV until evicted, so a prompt that starts with a cached prefix is prefilled from its end. The
hand-over still carries the whole prompt's KV: the receiving pools hold no cache of their own.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from lanes.device.batching import HostCopy, to_host_async
from lanes.engine.sequence import Sequence
from lanes.kv.prefix_cache import PrefixCache
from lanes.model.runner import ModelRunner
from lanes.sample.logprobs import TokenLogprobs, concat
from lanes.sample.matcher import FirstTokenMask
from lanes.sample.params import SamplingParams
from lanes.spec.prefill import PrefillChunk, PrefillLane, PrefillLogprobs, plan_whole_prompts


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
    target_kv: torch.Tensor | None  # [2, layers, kv_heads, prompt_len, head_dim]; None: kept in place
    draft_kv: torch.Tensor | None
    num_cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held
    logprobs: TokenLogprobs | None = None  # the first token's, when the request asked (the target's, raw)
    prompt_logprobs: TokenLogprobs | None = None  # echo: the prompt tokens', when asked


class PromptPrefiller:
    def __init__(self, target: ModelRunner, draft: ModelRunner | None, chunk_tokens: int, prefix_caching: bool = True):
        self.target = target  # runners over this lane's own scratch pools
        self.draft = draft
        self.chunk_tokens = chunk_tokens
        self.pools = [(target.pool, "target_slot")] + ([(draft.pool, "draft_slot")] if draft is not None else [])
        self.prefix_cache = PrefixCache(self.pools) if prefix_caching else None

    def prefill(self, requests: list[PrefillRequest]) -> list[PrefilledKV]:
        """Prefill into scratch slots, copy each request's KV out, free the slots."""
        kvs, release = self.prefill_in_scratch(requests)
        try:
            return [PrefilledKV(kv.first_token, kv.target_kv.clone(),
                                kv.draft_kv.clone() if kv.draft_kv is not None else None, kv.num_cached_tokens,
                                kv.logprobs, kv.prompt_logprobs)
                    for kv in kvs]
        finally:
            release()

    def prefill_in_scratch(self, requests: list[PrefillRequest]) -> tuple[list[PrefilledKV], Callable[[], None]]:
        """Prefill into scratch slots; the KV returned are gathered from their blocks (exactly each
        prompt's length, never a slot's capacity); `release()` frees the slots once they are sent.
        """
        t_slots = [self.target.pool.allocate() for _ in requests]
        d_slots = [self.draft.pool.allocate() for _ in requests] if self.draft else [None] * len(requests)

        def release() -> None:
            for t, d in zip(t_slots, d_slots):
                self.target.pool.free(t)
                if d is not None:
                    self.draft.pool.free(d)

        try:
            seqs, first = self._prefill_slots(requests, t_slots, d_slots)
            # Reading a prompt's KV out copies it (the hand-over): it can fail too, and must free the slots.
            return [PrefilledKV(tok, self.target.pool.read_slot(s.target_slot),
                                self.draft.pool.read_slot(s.draft_slot) if self.draft else None, s.num_cached_tokens,
                                logprobs, s.prompt_logprobs)
                    for (tok, logprobs), s in zip(first, seqs)], release
        except BaseException:
            release()
            raise

    def launch_in_place(self, requests: list[PrefillRequest]) -> "LaunchedPrefill":
        """The target's KV of each prompt prefilled into a slot of its own, which it keeps, no KV read out:
        for a lane that decodes from this pool itself (pdv's verify lane); a prefiller without a draft. The
        forwards are launched on the current stream and nothing waits for them here (`collect` does). Frees
        every slot if a launch fails (PoolFullError where the pool has no slot or blocks for one of them)."""
        assert self.draft is None, "the draft's KV is written where it drafts"
        pool, slots = self.target.pool, []
        try:
            for _ in requests:
                slots.append(pool.allocate())
            seqs = self._sequences(requests, slots, [None] * len(requests))
            return LaunchedPrefill(seqs, self._launch(seqs))
        except BaseException:
            for slot in slots:
                pool.free(slot)
            raise

    def collect(self, launched: "LaunchedPrefill") -> list[tuple[int, PrefilledKV]]:
        """Wait for launched forwards and read each prompt's first token: (slot, first token and logprobs)."""
        first = self._collect(launched.seqs, launched.forwards)
        return [(s.target_slot, PrefilledKV(tok, None, None, 0, logprobs, s.prompt_logprobs))
                for (tok, logprobs), s in zip(first, launched.seqs)]

    def _prefill_slots(self, requests: list[PrefillRequest], t_slots: list[int], d_slots: list[int | None]
                       ) -> tuple[list[Sequence], list[tuple[int, TokenLogprobs | None]]]:
        seqs = self._sequences(requests, t_slots, d_slots)
        return seqs, self._collect(seqs, self._launch(seqs))

    def _sequences(self, requests: list[PrefillRequest], t_slots: list[int], d_slots: list[int | None]
                   ) -> list[Sequence]:
        seqs = [Sequence(r.request_id, r.prompt_ids, r.params, r.seed, 0, target_slot=t, draft_slot=d,
                         grammar=None if r.token_bitmask is None else FirstTokenMask(r.token_bitmask))
                for r, t, d in zip(requests, t_slots, d_slots)]
        for seq in seqs:
            self._attach(seq)
        return seqs

    def _attach(self, seq: Sequence) -> None:
        """A scratch slot's blocks: the cached ones of the prompt's prefix, then new ones for the rest."""
        if self.prefix_cache is not None:
            seq.num_prefilled = seq.num_cached_tokens = self.prefix_cache.attach(seq)
        for pool, slot in self.pools:
            pool.reserve([getattr(seq, slot)], [seq.num_prompt_tokens])

    def _launch(self, seqs: list[Sequence]) -> list[tuple[list[PrefillChunk], HostCopy]]:
        """Every forward of the prompts (whole prompts that fit the budget together; a longer one in
        chunks), launched in order on the current stream, each with its result's copy to the host."""
        lane = PrefillLane(self.target, self.draft)
        forwards, left = [], list(seqs)
        while left:
            chunks = plan_whole_prompts(left, self.chunk_tokens)
            forwards.append((chunks, to_host_async(lane.run(chunks))))  # [B, 1 + packed logprobs]
            for chunk in chunks:
                chunk.seq.num_prefilled += chunk.length
                if self.prefix_cache is not None:
                    self.prefix_cache.register(chunk.seq)
            left = [s for s in left if s.num_prefilled < s.num_prefill_tokens]
        return forwards

    @staticmethod
    def _collect(seqs: list[Sequence], forwards: list[tuple[list[PrefillChunk], HostCopy]]
                 ) -> list[tuple[int, TokenLogprobs | None]]:
        """Each prompt's first token and its logprobs (when asked); prompt logprobs (echo) are left in
        each sequence's `prompt_logprobs`."""
        first: dict[str, tuple[int, TokenLogprobs | None]] = {}
        for chunks, copy in forwards:
            layout = PrefillLogprobs.of(chunks)
            for chunk, row in zip(chunks, copy.wait()):
                seq = chunk.seq
                seq.prompt_logprobs = concat([seq.prompt_logprobs, layout.prompt(chunk, row)])
                if chunk.completes_prompt:
                    first[seq.request_id] = int(row[0]), layout.first_token(chunk, row)
        return [first[s.request_id] for s in seqs]


@dataclass
class LaunchedPrefill:
    """Prompts whose forwards are launched into slots they keep (`PromptPrefiller.launch_in_place`)."""

    seqs: list[Sequence]
    forwards: list[tuple[list[PrefillChunk], HostCopy]]

    @property
    def slots(self) -> list[int]:
        return [s.target_slot for s in self.seqs]
