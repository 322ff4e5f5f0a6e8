"""The seams between the decode loop and the other two lanes.

The decode loop (EngineCore) drafts locally and reaches prefill and verify through these
protocols. In the co-located modes they are the local lanes below; in the disaggregated modes the
deployments inject proxies that ship the same objects to other Ray Serve replicas.
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch

from lanes.device.batching import HostCopy, to_host_async
from lanes.device.streams import on
from lanes.engine.scheduler import Scheduler, TargetSlots
from lanes.engine.sequence import SeqStatus, Sequence
from lanes.kv.pool import KVPool
from lanes.sample.logprobs import TokenLogprobs, concat
from lanes.spec.prefill import PrefillChunk, PrefillLane, PrefillLogprobs
from lanes.spec.verify import PendingVerify, VerifyBatch, VerifyLane, VerifyResult


class KVLost(RuntimeError):
    """A remote lane no longer holds a request's KV: the verify replica that owned it left (scaled
    down) or died. The request keeps every token it has and is recomputed elsewhere (EngineCore).

    `waited_s`: how long the call that found the loss had waited for an answer (a call that timed out),
    so the engine dates the loss to when that wait began; 0 where the loss was known at once."""

    waited_s: float = 0.0

    @classmethod
    def after_waiting(cls, message: str, waited_s: float) -> "KVLost":
        lost = cls(message)
        lost.waited_s = waited_s  # an instance attribute: it travels with the pickled error
        return lost


class LaneOOM(RuntimeError):
    """A remote lane ran out of device memory in the forward that carried this request, after retrying
    it smaller: the request is recomputed, as after an out-of-memory error in the engine's own step
    (EngineCore; bounded by max_oom_attempts)."""


class PendingResult(Protocol):
    def result(self) -> VerifyResult:
        """Wait for the verify step (its device work or its remote call) and read what it accepted."""


class Verifier(TargetSlots, Protocol):
    def launch(self, batch: VerifyBatch) -> PendingResult:
        """Start verifying `batch` and return without waiting, so that the engine can launch its
        prefill work meanwhile."""


class Prefiller(Protocol):
    # Whether this prefiller computes the logprobs requests ask for (the first output token's, the prompt's).
    serves_logprobs: bool
    # Results that arrived from elsewhere and wait for `step` to take them in, some perhaps of requests
    # aborted meanwhile whose slots only `step` gives back: the engine steps until there are none.
    has_replies: bool
    # Whether prefill starts where a request's cached prefix ends (lanes/kv/prefix_cache.py); a remote
    # prefill lane computes and hands over whole prompts.
    reuses_cached_blocks: bool
    # Whether a request's draft KV may lag its target KV after prefill (written only for requests that
    # draft; the draft's catch-up writes the rest when they do): a prefill lane of its own hands both
    # caches over whole.
    draft_may_lag: bool
    # Whether this engine runs prefill forwards itself (and so captures prefill CUDA graphs).
    prefills_here: bool

    def take_in(self, scheduler: Scheduler, budget_tokens: int, decoding: bool
                ) -> list[tuple[Sequence, int | BaseException, TokenLogprobs | None]]:
        """Before the step drafts: send prompts to a prefill lane of its own and take in the results
        that came back from it (they cost this step no device time, so a prompt landed here decodes in
        this very step). Returns what `step` returns."""

    def step(self, scheduler: Scheduler, budget_tokens: int, decoding: bool
             ) -> list[tuple[Sequence, int | BaseException, TokenLogprobs | None]]:
        """While the step verifies: advance this engine's own prefill of the scheduler's PREFILLING
        requests; return (request, first token, its logprobs if asked) for each whose prompt is now in
        both caches, or (request, error, None) where prefill failed. Prompt logprobs accumulate in
        `Sequence.prompt_logprobs`. `decoding`: requests are decoding, so prefill may overlap with
        their next step (its launch overlaps the verify)."""

    def holds_blocks(self, seq: Sequence) -> bool:
        """Whether a prefill in flight elsewhere writes this prefilling sequence's blocks, so that they
        may not be freed yet: the prefiller frees them when the write has landed."""

    def forget(self, seq: Sequence) -> None:
        """A prefilling sequence is released now: finish or drop whatever of it is in flight here."""


class LocalVerifier:
    def __init__(self, lane: VerifyLane):
        self.lane = lane

    def launch(self, batch: VerifyBatch) -> PendingVerify:
        return self.lane.launch(batch)

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
    first_tokens: HostCopy  # [B, 1 + packed logprobs]
    dropped: set[int] = field(default_factory=set)  # ids of sequences released while in flight


class LocalPrefiller:
    """Chunked prefill in the engine's own process, within a token budget per step.

    On a GPU the chunk runs on the low-priority prefill stream and is collected at a later step,
    so it overlaps with decoding instead of delaying it; one batch of chunks is in flight at a
    time. On the CPU, or when nothing is decoding, it completes within the step.
    """

    has_replies = False  # what it launched is collected with the requests still prefilling
    reuses_cached_blocks = True
    prefills_here = True

    def __init__(self, lane: PrefillLane, stream: torch.cuda.Stream | None = None):
        self.lane = lane
        self.stream = stream
        self._launched: _Launched | None = None

    @property
    def draft_may_lag(self) -> bool:
        return self.lane.lazy_draft

    def take_in(self, scheduler: Scheduler, budget_tokens: int, decoding: bool) -> list:
        return []  # its chunks are launched while the step verifies (`step`)

    def step(self, scheduler: Scheduler, budget_tokens: int, decoding: bool
             ) -> list[tuple[Sequence, int, TokenLogprobs | None]]:
        done = self._collect(scheduler, wait=False)
        if self._launched is None:
            self._launch(scheduler, budget_tokens)
            if self.stream is None or not decoding:
                done += self._collect(scheduler, wait=True)
        return done

    def holds_blocks(self, seq: Sequence) -> bool:
        return False  # what is in flight here is waited for by `forget`

    def forget(self, seq: Sequence) -> None:
        # A chunk of `seq` on the prefill stream may still write its blocks: wait for it (rare: aborts
        # and preemptions of prompts mid-prefill), and drop its result, which may not be applied to the
        # sequence if it is admitted again.
        launched = self._launched
        if launched is not None and any(c.seq is seq for c in launched.chunks):
            launched.first_tokens.wait()
            launched.dropped.add(id(seq))

    def _launch(self, scheduler: Scheduler, budget_tokens: int) -> None:
        chunks = scheduler.prefill_chunks(budget_tokens)
        if not chunks:
            return
        with on(self.stream):
            self._launched = _Launched(chunks, to_host_async(self.lane.run(chunks)))

    def _collect(self, scheduler: Scheduler, wait: bool) -> list[tuple[Sequence, int, TokenLogprobs | None]]:
        launched = self._launched
        if launched is None or not (wait or launched.first_tokens.ready):
            return []
        self._launched = None
        done = []
        layout = PrefillLogprobs.of(launched.chunks)
        for chunk, row in zip(launched.chunks, launched.first_tokens.wait()):
            seq = chunk.seq
            if seq.status is not SeqStatus.PREFILLING or id(seq) in launched.dropped:
                continue  # aborted or preempted meanwhile; its slots were freed
            scheduler.mark_prefilled(chunk)
            seq.prompt_logprobs = concat([seq.prompt_logprobs, layout.prompt(chunk, row)])
            if chunk.completes_prompt:
                done.append((seq, int(row[0]), layout.first_token(chunk, row)))
        return done
