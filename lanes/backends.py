"""The seams between the decode loop and the other two lanes.

The decode loop (EngineCore) drafts locally and reaches prefill and verify through these
protocols. In the co-located modes they are the local lanes below; in the disaggregated modes the
deployments inject proxies that ship the same objects to other Ray Serve replicas.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from lanes.kv_pool import KVPool
from lanes.logprobs import TokenLogprobs, concat
from lanes.prefill import PrefillChunk, PrefillLane, PrefillLogprobs
from lanes.scheduler import Scheduler
from lanes.sequence import SeqStatus, Sequence
from lanes.streams import on
from lanes.verify import VerifyBatch, VerifyLane, VerifyResult


class Verifier(Protocol):
    def verify(self, batch: VerifyBatch) -> VerifyResult: ...

    def allocate(self) -> int | None:
        """A target KV slot for a new request, or None when the slot is assigned by the prefill lane."""

    def release(self, target_slot: int, lease: str | None = None) -> None:
        """Give back a target slot; `lease` names the pool instance that handed it out (remote pools)."""


class Prefiller(Protocol):
    # Whether this prefiller computes the logprobs requests ask for (the first output token's, the prompt's).
    serves_logprobs: bool
    # Results that arrived from elsewhere and wait for `step` to take them in, some perhaps of requests
    # aborted meanwhile whose slots only `step` gives back: the engine steps until there are none.
    has_replies: bool

    def step(self, scheduler: Scheduler, budget_tokens: int, decoding: bool
             ) -> list[tuple[Sequence, int | BaseException, TokenLogprobs | None]]:
        """Advance prefill of the scheduler's PREFILLING requests; return (request, first token, its
        logprobs if asked) for each whose prompt is now in both caches, or (request, error, None)
        where prefill failed. Prompt logprobs accumulate in `Sequence.prompt_logprobs`.
        `decoding`: requests are decoding, so prefill may overlap with their next step."""


class LocalVerifier:
    def __init__(self, lane: VerifyLane):
        self.lane = lane

    def verify(self, batch: VerifyBatch) -> VerifyResult:
        return self.lane.verify(batch)

    def allocate(self) -> int | None:
        return self.lane.pool.allocate()

    def release(self, target_slot: int, lease: str | None = None) -> None:
        self.lane.pool.free(target_slot)

    @property
    def pool(self) -> KVPool:
        return self.lane.pool


@dataclass
class _Launched:
    chunks: list[PrefillChunk]
    first_tokens: torch.Tensor  # [B, 1 + packed logprobs] on the host (filled asynchronously on CUDA)
    done: torch.cuda.Event | None


class LocalPrefiller:
    """Chunked prefill in the engine's own process, within a token budget per step.

    On a GPU the chunk runs on the low-priority prefill stream and is collected at a later step,
    so it overlaps with decoding instead of delaying it; one batch of chunks is in flight at a
    time. On the CPU, or when nothing is decoding, it completes within the step.
    """

    serves_logprobs = True
    has_replies = False  # what it launched is collected with the requests still prefilling

    def __init__(self, lane: PrefillLane, stream: torch.cuda.Stream | None = None):
        self.lane = lane
        self.stream = stream
        self._launched: _Launched | None = None

    def step(self, scheduler: Scheduler, budget_tokens: int, decoding: bool
             ) -> list[tuple[Sequence, int, TokenLogprobs | None]]:
        done = self._collect(scheduler, wait=False)
        if self._launched is None:
            self._launch(scheduler, budget_tokens)
            if self.stream is None or not decoding:
                done += self._collect(scheduler, wait=True)
        return done

    def _launch(self, scheduler: Scheduler, budget_tokens: int) -> None:
        chunks = scheduler.prefill_chunks(budget_tokens)
        if not chunks:
            return
        with on(self.stream):
            first = self.lane.run(chunks)
            if self.stream is None:
                self._launched = _Launched(chunks, first, None)
                return
            host = torch.empty(first.shape, dtype=first.dtype, pin_memory=True)
            host.copy_(first, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._launched = _Launched(chunks, host, event)

    def _collect(self, scheduler: Scheduler, wait: bool) -> list[tuple[Sequence, int, TokenLogprobs | None]]:
        launched = self._launched
        if launched is None or (launched.done is not None and not wait and not launched.done.query()):
            return []
        if launched.done is not None:
            launched.done.synchronize()
        self._launched = None
        done = []
        layout = PrefillLogprobs.of(launched.chunks)
        for chunk, row in zip(launched.chunks, launched.first_tokens):
            seq = chunk.seq
            if seq.status is not SeqStatus.PREFILLING:
                continue  # aborted meanwhile; its slots were freed (later prefills queue behind this one)
            scheduler.mark_prefilled(chunk)
            seq.prompt_logprobs = concat([seq.prompt_logprobs, layout.prompt(chunk, row)])
            if chunk.completes_prompt:
                done.append((seq, int(row[0]), layout.first_token(chunk, row)))
        return done
