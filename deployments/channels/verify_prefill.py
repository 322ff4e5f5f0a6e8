"""pdv's short prompts prefilled where they decode: the target's KV by a verify replica, the draft's here.

Through the prefill lane a prompt goes decode replica -> prefill replica (queue, forward) -> its KV
copied into a verify replica's pool -> back, before its first decode step: under MPS on one H200,
pdv's TTFT p50 was 197 ms against unified's 113-124. pd prefills its short prompts in its decode lane
(lanes/engine/split_prefill.py); pdv's decode lane holds only the draft, so a short prompt's target
half goes to the verify lane, which is where its KV must end up anyway: one call prefills it into a
slot of that replica's pool and returns the slot and the first token. Meanwhile this engine writes
the draft's KV on its low-priority prefill stream. The request decodes once both have landed. On one
H200 this cut pdv's TTFT p50 by about 60 ms; its tok/s at 64 in flight moved within run-to-run noise
(0.80x of unified against 0.78x), since pdv's cycle, not its TTFT, sets that (docs/lanes_one_gpu.md).
"""

import torch

from deployments.channels.remote import RemotePrefiller, VerifyPrefillOrder
from lanes.device.batching import pad_tokens
from lanes.device.streams import on
from lanes.engine.scheduler import Scheduler
from lanes.engine.sequence import SeqStatus, Sequence
from lanes.model.runner import ModelRunner
from lanes.sample.grammar import first_token_bitmask
from lanes.spec.prefill import PrefillLane, plan_whole_prompts
from lanes.spec.prompt_prefiller import PrefillRequest


class VerifyLanePrefiller(RemotePrefiller):
    """A RemotePrefiller whose orders go to the verify lane (`VerifyPrefillOrder`, answered by
    `VerifyServer.prefill`), and which writes each prompt's draft KV itself with `draft` (None when
    drafting by prompt lookup). A reply lands only once that write has finished on the device, so
    neither a drafting step nor a freed block is ever ahead of it."""

    def __init__(self, link, draft: ModelRunner | None, stream: torch.cuda.Stream | None, placement, owner: str):
        super().__init__(link, draft.pool if draft is not None else None, None, placement, owner)
        self.draft = draft
        self.stream = stream
        self._unwritten: dict[str, Sequence] = {}  # sent, draft KV not yet launched
        self._writing: dict[str, torch.cuda.Event | None] = {}  # draft KV launched; None: done (off CUDA)

    def take_in(self, scheduler: Scheduler, budget_tokens: int, decoding: bool) -> list:
        # Orders first (their round trip is the longer part), then this step's draft writes, then the replies.
        sent = self._send_new(scheduler)
        if self.draft is not None:
            self._unwritten.update((seq.request_id, seq) for seq in sent)
            self._write_drafts(budget_tokens)
        return self._land_replies(scheduler)

    def _order(self, seq: Sequence) -> VerifyPrefillOrder:
        # After a preemption: every token but the last (lanes/engine/sequence.py), whose KV is recomputed.
        return VerifyPrefillOrder(PrefillRequest(seq.request_id, seq.token_ids[: seq.num_prefill_tokens], seq.params,
                                                 seq.seed, first_token_bitmask(seq)))

    def _write_drafts(self, budget_tokens: int) -> None:
        """Launch one forward of the draft over prompts still unwritten, whole prompts within the step's
        budget (at least one: a short prompt is at most `local_prefill_max_tokens`, within the lane's
        memory profile), on the prefill stream."""
        for request_id, seq in list(self._unwritten.items()):
            if seq.status is not SeqStatus.PREFILLING:  # aborted before its write: nothing to wait for
                del self._unwritten[request_id]
        if not self._unwritten:
            return
        seqs = list(self._unwritten.values())
        chunks = plan_whole_prompts(seqs, max(budget_tokens, seqs[0].num_prefill_tokens))
        chunks = [c for c in chunks if c.start == 0 and c.completes_prompt]
        ids, last = pad_tokens([c.token_ids for c in chunks], self.draft.device)
        with on(self.stream):
            PrefillLane.write(self.draft, [c.seq.draft_slot for c in chunks], ids, [0] * len(chunks), chunks, last)
            done = None
            if self.stream is not None:
                done = torch.cuda.Event()
                done.record(self.stream)
        for chunk in chunks:
            del self._unwritten[chunk.seq.request_id]
            self._writing[chunk.seq.request_id] = done

    def _ready(self, seq: Sequence) -> bool:
        if seq.request_id in self._unwritten:
            return False  # its write is launched at a later step
        if seq.request_id not in self._writing:
            return True
        done = self._writing[seq.request_id]
        if done is not None and not done.query():
            return False
        del self._writing[seq.request_id]
        return True

    def forget(self, seq: Sequence) -> None:
        super().forget(seq)
        self._unwritten.pop(seq.request_id, None)
