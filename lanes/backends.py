"""The seams between the decode loop and the other two lanes.

The decode loop (EngineCore) drafts locally and reaches prefill and verify through these
protocols. In the co-located modes they are the local lanes below; in the disaggregated modes the
deployments inject proxies that ship the same objects to other Ray Serve replicas.
"""

from typing import Protocol

from lanes.kv_pool import KVPool
from lanes.prefill import PrefillLane
from lanes.sampling import SamplingTensors
from lanes.scheduler import Scheduler
from lanes.sequence import Sequence
from lanes.verify import VerifyBatch, VerifyLane, VerifyResult


class Verifier(Protocol):
    def verify(self, batch: VerifyBatch) -> VerifyResult: ...

    def allocate(self) -> int | None:
        """A target KV slot for a new request, or None when the slot is assigned by the prefill lane."""

    def release(self, target_slot: int) -> None: ...


class Prefiller(Protocol):
    def step(self, scheduler: Scheduler, budget_tokens: int) -> list[tuple[Sequence, int | BaseException]]:
        """Advance prefill of the scheduler's PREFILLING requests; return (request, first token)
        for each whose prompt is now in both caches, or (request, error) where prefill failed."""


class LocalVerifier:
    def __init__(self, lane: VerifyLane):
        self.lane = lane

    def verify(self, batch: VerifyBatch) -> VerifyResult:
        return self.lane.verify(batch)

    def allocate(self) -> int | None:
        return self.lane.pool.allocate()

    def release(self, target_slot: int) -> None:
        self.lane.pool.free(target_slot)

    @property
    def pool(self) -> KVPool:
        return self.lane.pool


class LocalPrefiller:
    """Chunked prefill in the engine's own step, after decode work, within a token budget."""

    def __init__(self, lane: PrefillLane):
        self.lane = lane

    def step(self, scheduler: Scheduler, budget_tokens: int) -> list[tuple[Sequence, int]]:
        chunks = scheduler.prefill_chunks(budget_tokens)
        if not chunks:
            return []
        seqs = [c.seq for c in chunks]
        st = SamplingTensors.build([s.params for s in seqs], [s.seed for s in seqs], self.lane.target.device)
        first = self.lane.run(chunks, st).cpu().tolist()
        done = []
        for chunk, token in zip(chunks, first):
            scheduler.mark_prefilled(chunk)
            if chunk.completes_prompt:
                done.append((chunk.seq, token))
        return done
