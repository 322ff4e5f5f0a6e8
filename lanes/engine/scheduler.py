"""Who runs next: decode work first, prefill in bounded chunks after it; who holds KV blocks.

Every engine step drafts and verifies ALL running sequences, then spends at most a token budget on
prompt prefill. A long prompt therefore delays a decode step by one chunk at most: decode is never
starved by prefill.

Memory is admitted in KV blocks (lanes/kv/pool.py), not slots: a request is admitted when the
blocks of its whole prompt are free in every pool this engine holds, with room left for one decode
step of every admitted sequence; `max_num_seqs` only caps how many run at once. Sequences
grow a block at a time while decoding. When a step's growth does not fit, the most recently
admitted sequences are preempted by recompute (vLLM's policy): their blocks are freed and they go
back to the front of the queue with every token they have, so their prefill rebuilds the KV and
their output continues where it stopped. A request never fails for lack of blocks.
"""

from collections import deque
from collections.abc import Callable
from typing import Protocol

from lanes.engine.sequence import SeqStatus, Sequence
from lanes.kv.pool import KVPool, PoolFullError
from lanes.kv.prefix_cache import PrefixCache
from lanes.spec.prefill import PrefillChunk, plan_chunks


class TargetSlots(Protocol):
    """What the scheduler needs of the verify side (lanes/engine/backends.py's Verifier is one)."""

    def allocate(self) -> int | None:
        """A target KV slot for a new request, or None when the slot is assigned by the prefill lane."""

    def release(self, target_slot: int, lease: str | None = None) -> None:
        """Give back a target slot; `lease` names the pool instance that handed it out (remote pools)."""


class Scheduler:
    def __init__(self, verifier: TargetSlots, draft_pool: KVPool | None, target_pool: KVPool | None = None,
                 max_num_seqs: int | None = None, prefix_caching: bool = False, step_tokens: int = 1,
                 draft_may_lag: bool = False):
        self.verifier = verifier  # hands out and takes back target slots
        self.draft_pool = draft_pool
        # The pools whose blocks this engine allocates (a remote verify lane's are its own business).
        self.pools = [(pool, name) for pool, name in ((target_pool, "target_slot"), (draft_pool, "draft_slot"))
                      if pool is not None]
        self.max_num_seqs = max_num_seqs
        self.step_tokens = step_tokens  # the most tokens one decode step adds to a sequence (L + 1)
        # draft_may_lag: the prefiller writes draft KV only for requests that draft (Prefiller.draft_may_lag).
        lagging = ("draft_slot",) if draft_may_lag else ()
        self.prefix_cache = PrefixCache(self.pools, lagging) if prefix_caching and self.pools else None
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # prompt tokens planned into this engine's own prefill chunks, since start
        self.planned: list[Sequence] = []  # the sequences of the prefill chunks planned last (a failed forward's)
        # Set by the engine from its prefiller (lanes/engine/backends.py): whether a prefill in flight elsewhere
        # writes a prefilling sequence's blocks (freed when its result lands), and what to do with
        # one's work in flight here when it is released.
        self.holds_blocks: Callable[[Sequence], bool] = lambda seq: False
        self.forget: Callable[[Sequence], None] = lambda seq: None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_admitted(self) -> int:
        return len(self.prefilling) + len(self.running)

    def admit(self) -> None:
        """Give waiting requests a slot and the blocks of their prompt, in arrival order, while both fit."""
        while self.waiting and (self.max_num_seqs is None or self.num_admitted < self.max_num_seqs):
            seq = self.waiting[0]
            # Room for every admitted sequence's next step, or the newcomer would only be preempted again.
            if not all(pool.num_free_blocks >= _blocks(pool, seq.num_prefill_tokens)
                       + self.num_admitted * _blocks(pool, self.step_tokens) for pool, _ in self.pools):
                return
            if self.draft_pool is not None and not self.draft_pool.num_free:
                return
            try:
                target_slot = self.verifier.allocate()
            except PoolFullError:
                return
            self.waiting.popleft()
            seq.target_slot = target_slot
            if self.draft_pool is not None:
                seq.draft_slot = self.draft_pool.allocate()
            if self.prefix_cache is not None:
                seq.num_prefilled = self.prefix_cache.attach(seq)
                if not seq.resumed:
                    seq.num_cached_tokens = seq.num_prefilled
            for pool, slot in self.pools:
                pool.reserve([getattr(seq, slot)], [seq.num_prefill_tokens])
            seq.status = SeqStatus.PREFILLING
            self.prefilling.append(seq)

    def make_room(self, tokens_after_step: Callable[[Sequence], int]) -> None:
        """Preempt until every running sequence's next step (`tokens_after_step`: the tokens its KV
        must hold once the step has written them) fits the free blocks of every pool."""
        while self.running and self._short(tokens_after_step):
            # Prompts still prefilling first (the least work lost), then the latest admitted; never a
            # prompt whose remote prefill is in flight (its blocks are being written).
            victims = [s for s in self.prefilling if not self.holds_blocks(s)] or self.running[1:]
            if not victims:
                return  # one sequence left: the pool holds one of any length, so this cannot be short
            self.preempt(victims[-1])

    def _short(self, tokens_after_step: Callable[[Sequence], int]) -> bool:
        tokens = [tokens_after_step(s) for s in self.running]
        return any(pool.blocks_needed([getattr(s, slot) for s in self.running], tokens) > pool.num_free_blocks
                   for pool, slot in self.pools)

    def preempt(self, seq: Sequence) -> None:
        """Free a sequence's KV and queue it first again, keeping its tokens (recomputed by prefill)."""
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_prefilled = 0
        seq.prompt_logprobs = None  # sent already, or gathered again from the start
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def prefill_chunks(self, budget_tokens: int, seqs: list[Sequence] | None = None) -> list[PrefillChunk]:
        """This step's chunks of the prompts prefilling (`seqs`: of these of them only)."""
        chunks = plan_chunks(self.prefilling if seqs is None else seqs, budget_tokens)
        self.num_prefill_tokens += sum(c.length for c in chunks)
        self.planned = [c.seq for c in chunks]
        return chunks

    def mark_prefilled(self, chunk: PrefillChunk) -> None:
        chunk.seq.num_prefilled += chunk.length
        if self.prefix_cache is not None:
            self.prefix_cache.register(chunk.seq)
        if chunk.completes_prompt:
            self.prefilling.remove(chunk.seq)
            chunk.seq.status = SeqStatus.RUNNING
            self.running.append(chunk.seq)

    def finish(self, seq: Sequence, reason: str, keep_slots: bool = False) -> None:
        """Release a request's slots, whatever state it is in (finished, aborted, failed). `keep_slots`
        (a running request): the caller gives them back later (`release_slots`), once a step still in
        flight that writes them has been read."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self._release(seq, keep_slots)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.by_id.pop(seq.request_id, None)

    def _release(self, seq: Sequence, keep_slots: bool = False) -> None:
        (self.prefilling if seq.status is SeqStatus.PREFILLING else self.running).remove(seq)
        if seq.status is SeqStatus.PREFILLING:
            if self.holds_blocks(seq):
                return  # the prefiller calls release_slots when its result lands
            self.forget(seq)
        if not keep_slots:
            self.release_slots(seq)

    def release_slots(self, seq: Sequence) -> None:
        """Give back a sequence's slots and their blocks."""
        if seq.target_slot is not None:
            self.verifier.release(seq.target_slot, seq.target_lease)
        if seq.draft_slot is not None and self.draft_pool is not None:
            self.draft_pool.free(seq.draft_slot)
        seq.target_slot = seq.draft_slot = seq.target_lease = None


def _blocks(pool: KVPool, tokens: int) -> int:
    return -(-tokens // pool.block_size)
