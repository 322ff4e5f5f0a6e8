"""Who runs next: decode work first, prefill in bounded chunks after it.

Every engine step drafts and verifies ALL running sequences, then spends at most a token budget on
prompt prefill. A long prompt therefore delays a decode step by one chunk at most: decode is never
starved by prefill.
"""

from collections import deque
from typing import TYPE_CHECKING

from lanes.kv_pool import KVPool, PoolFullError
from lanes.prefill import PrefillChunk, plan_chunks
from lanes.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from lanes.backends import Verifier


class Scheduler:
    def __init__(self, verifier: "Verifier", draft_pool: KVPool | None):
        self.verifier = verifier  # hands out and takes back target slots
        self.draft_pool = draft_pool
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def admit(self) -> None:
        """Give waiting requests KV slots, in arrival order, while slots are free."""
        while self.waiting and (self.draft_pool is None or self.draft_pool.num_free):
            try:
                target_slot = self.verifier.allocate()
            except PoolFullError:
                return
            seq = self.waiting.popleft()
            seq.target_slot = target_slot
            if self.draft_pool is not None:
                seq.draft_slot = self.draft_pool.allocate()
            seq.status = SeqStatus.PREFILLING
            self.prefilling.append(seq)

    def prefill_chunks(self, budget_tokens: int) -> list[PrefillChunk]:
        return plan_chunks(self.prefilling, budget_tokens)

    def mark_prefilled(self, chunk: PrefillChunk) -> None:
        chunk.seq.num_prefilled += chunk.length
        if chunk.completes_prompt:
            self.prefilling.remove(chunk.seq)
            chunk.seq.status = SeqStatus.RUNNING
            self.running.append(chunk.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Release a request's slots, whatever state it is in (finished, aborted, failed)."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.PREFILLING:
            self.prefilling.remove(seq)
        else:
            self.running.remove(seq)
        if seq.target_slot is not None:
            self.verifier.release(seq.target_slot, seq.target_lease)
        if seq.draft_slot is not None and self.draft_pool is not None:
            self.draft_pool.free(seq.draft_slot)
        seq.target_slot = seq.draft_slot = seq.target_lease = None
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.by_id.pop(seq.request_id, None)
