"""Decode lane: the draft model proposes up to L tokens for every active sequence, one batched
forward per drafted position.

Host work per step is one pass over the sequences and one host-to-device copy of their inputs;
between the L forwards the rows advance on the device, and nothing is read back (with a grammar, each
drawn token is, while the next forward runs: the next position's mask depends on it).
"""

import itertools
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from lanes.device.batching import PAD_TOKEN_ID, pad_rows, pad_tokens, to_device, to_host_async
from lanes.engine.sequence import Sequence
from lanes.model.runner import ModelRunner, Rows
from lanes.sample.grammar import ColumnMasks
from lanes.sample.penalties import Penalties, PenaltyHistory
from lanes.sample.sampling import STREAM_DRAFT, SamplingTensors, draw

if TYPE_CHECKING:
    from lanes.kv.pool import KVPool
    from lanes.spec.verify import PendingVerify

CATCH_UP_CHUNK = 64  # tokens per catch-up forward for a sequence whose draft cache fell behind
# Catch-up forwards one step runs at most. A row's draft cache may lag by a whole prompt (prefilled at L = 0,
# lanes/spec/prefill.py): caught up at once, a 7,000-token prompt would hold one step for ~110 forwards.
CATCH_UP_FORWARDS = 2


@dataclass
class DraftProposal:
    """What travels from the decode lane to the verify lane: token ids and probabilities only."""

    tokens: torch.Tensor  # [B, L] int64, rows padded past their own length
    probs: torch.Tensor | None  # [B, L, V] the distribution q each token was drawn from; None when q
    # is one-hot at every token (greedy rows, or a lookup proposer): 4 bytes a token travel, not 4 V
    num_draft: list[int]  # tokens drafted per row (a lookup proposer may find fewer than asked)
    masks: ColumnMasks | None = None  # rows with a grammar: the bitmasks the draft was sampled under
    # Drafted before the step it follows was read (DraftLane.propose_ahead): the draft pool's lengths are
    # set on the host once this step is read (EngineCore._finish_decode).
    ahead: bool = False

    @classmethod
    def empty(cls, batch: int, device) -> "DraftProposal":
        return cls(torch.zeros(batch, 0, dtype=torch.long, device=device), None, [0] * batch)


def verify_bitmask(seqs: list["Sequence"], proposal: "DraftProposal") -> torch.Tensor | None:
    """The verify batch's per-column bitmasks [B, L + 1, W] (host), or None when no row has a grammar.
    Drafts the grammar cuts short are cut in `proposal.num_draft` too."""
    masks = proposal.masks
    if masks is None:
        masks = ColumnMasks.of(seqs, proposal.num_draft, proposal.tokens.shape[1] + 1)
    if masks is None:
        return None
    masks.follow(proposal.tokens)
    proposal.num_draft = masks.num_draft
    return masks.bitmask()


class Proposer(Protocol):
    """What the decode loop drafts with: a draft model (DraftLane) or prompt lookup (NgramProposer)."""

    def propose(self, seqs: list[Sequence], draft_lens: list[int]) -> DraftProposal:
        """At most `draft_lens[i]` draft tokens for `seqs[i]`."""


class DraftLane:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def propose(self, seqs: list[Sequence], draft_lens: list[int]) -> DraftProposal:
        """Draft `draft_lens[i]` tokens for `seqs[i]` (0 allowed), sampling as each request asks. A row
        whose draft cache is still catching up drafts nothing this step (`num_draft` 0)."""
        batch, device = len(seqs), self.runner.device
        drafting = [i for i, n in enumerate(draft_lens) if n > 0]
        slots = [seqs[i].draft_slot for i in drafting]
        num_tokens = [len(seqs[i].token_ids) for i in drafting]
        lagging = self._catch_up([seqs[i] for i in drafting], slots, num_tokens)
        if lagging.any():  # rows still catching up draft nothing this step
            keep = np.flatnonzero(~lagging).tolist()
            drafting, slots, num_tokens = [drafting[k] for k in keep], [slots[k] for k in keep], [num_tokens[k] for k in keep]
        if not drafting:
            return DraftProposal.empty(batch, device)
        asked = [0] * batch  # the model drafts every token asked for
        for i in drafting:
            asked[i] = draft_lens[i]
        max_len = max(asked)
        all_seqs, seqs, draft_lens = seqs, [seqs[i] for i in drafting], [asked[i] for i in drafting]
        st = SamplingTensors.build([s.params for s in seqs], [s.seed for s in seqs], device)
        # The grammar's column masks (None unless a row has one), made once the first forward is queued,
        # so that their host work overlaps it.
        masks = partial(ColumnMasks.of, all_seqs, asked, max_len + 1)
        tokens, probs, masks = self._draft(seqs, slots, num_tokens, draft_lens, max_len, st, masks,
                                           drafting)  # [B', L], [B', L, V] | None
        if len(drafting) == batch:
            return DraftProposal(tokens, probs, asked, masks)
        index = to_device(drafting, torch.long, device)
        full_tokens = tokens.new_zeros(batch, max_len).index_copy_(0, index, tokens)
        full_probs = None if probs is None else probs.new_zeros(batch, max_len, probs.shape[-1]).index_copy_(0, index, probs)
        return DraftProposal(full_tokens, full_probs, asked, masks)

    def _draft(self, seqs: list[Sequence], slots: list[int], num_tokens: list[int], draft_lens: list[int],
               max_len: int, st: SamplingTensors, make_masks=lambda: None, batch_rows: list[int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, ColumnMasks | None]:
        """`make_masks`: the grammar's column masks, by `batch_rows` (the batch rows of `seqs`); each
        position is drawn under its mask. The mask of position j + 1 needs the token drawn at j: that
        token is copied to the host while the forward of j + 1 runs, and the host fills the mask
        meanwhile, so the GPU waits only for the copy, not for the host's work."""
        pool = self.runner.pool
        kv_lens = pool.lengths[slots].tolist()
        pool.reserve(slots, np.add(num_tokens, draft_lens) - 1)  # up to draft n - 1 (later drafts are junk)
        # 1 or 2 tokens after catch-up: the last committed one, and the one before it after a full accept.
        pending, last = pad_rows([s.token_ids[n:] for s, n in zip(seqs, kv_lens)])
        # Every per-row input of the L forwards in one copy: [4 + Q, B].
        host = to_device([slots, kv_lens, last, num_tokens, *zip(*pending)], torch.long, self.runner.device)
        slot_ids, starts, keep, base = host[:4]  # base: absolute position of draft 0, len(token_ids)
        logits = self.runner.forward(Rows(slot_ids, starts, max(kv_lens)), host[4:].T, keep=keep)  # [B, V]
        masks = make_masks()
        rows = Rows(slot_ids, base, max(num_tokens))  # every row now holds its committed tokens
        # The target's penalties on the draft's own proposals, for acceptance (correctness never needs them).
        penalties = Penalties.build([s.params for s in seqs], PenaltyHistory.of(seqs), logits.shape[-1], logits.device)
        tokens, probs = self._draw_drafts(logits, rows, max_len, st, penalties, masks, batch_rows)
        set_drafted_lengths(pool, slots, num_tokens, draft_lens)
        return tokens, probs, masks  # [B, L], [B, L, V]

    def propose_ahead(self, seqs: list[Sequence], draft_lens: list[int], verified: "PendingVerify",
                      num_tokens: list[int]) -> DraftProposal:
        """Async scheduling: draft the step after `verified`, a verify step of the same rows not read yet,
        from what it commits, taken on the device. Each row drafted n > 0 tokens in that step (T committed
        before it, `num_tokens`): once k are accepted, its draft cache holds T + min(k, n - 1) tokens
        (lanes/spec/rollback.py), so the input is the bonus token alone (k < n) or the last draft and the
        bonus token (k = n), as `_draft` pads them. No penalties, grammar or catch-up (EngineCore._launch_next)."""
        pool, device = self.runner.pool, self.runner.device
        slots, n = [s.draft_slot for s in seqs], np.asarray(verified.batch.num_draft)
        most = np.add(num_tokens, n)  # the largest T' - 1
        pool.reserve(slots, most + draft_lens)  # up to draft n' - 1 after the longest acceptance
        accepted, n_rows = verified.out.num_accepted, verified.num_draft  # [B], [B] on the device
        bonus = verified.out.tokens.gather(1, accepted[:, None])[:, 0]
        full = accepted == n_rows
        last_draft = verified.inputs.gather(1, n_rows[:, None])[:, 0]  # column 0 is the token before the drafts
        pair = torch.stack([torch.where(full, last_draft, bonus), torch.where(full, bonus, PAD_TOKEN_ID)], dim=1)
        before = verified.rows.starts + 1  # T
        slot_ids = to_device(slots, torch.long, device)
        starts = before + torch.minimum(accepted, n_rows - 1)
        logits = self.runner.forward(Rows(slot_ids, starts, int(most.max()) - 1), pair, keep=full.long())  # [B, V]
        base = before + accepted + 1  # T': every row now holds its committed tokens
        st = SamplingTensors.build([s.params for s in seqs], [s.seed for s in seqs], device)
        rows = Rows(slot_ids, base, int(most.max()) + 1)
        tokens, probs = self._draw_drafts(logits, rows, max(draft_lens), st)
        return DraftProposal(tokens, probs, list(draft_lens), ahead=True)

    def _draw_drafts(self, logits: torch.Tensor, rows: Rows, max_len: int, st: SamplingTensors,
                     penalties: Penalties | None = None, masks: ColumnMasks | None = None,
                     batch_rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draw `max_len` drafts a row from the logits at each row's committed end (`rows.starts`: T), one
        forward per draft after the first. Returns [B, L] and their distributions [B, L, V] (None: greedy)."""
        base, tokens, probs = rows.starts, [], []
        for j in range(max_len):
            if masks is not None:
                logits = masks.apply(logits, j, batch_rows)
            scores = logits[:, None] if penalties is None else penalties.apply(logits[:, None], _cat(tokens), first=j)
            token, q = draw(scores, st, base[:, None] + j, STREAM_DRAFT)  # [B, 1], [B, 1, V] | None
            drawn = to_host_async(token[:, 0]) if masks is not None else None
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if j + 1 < max_len:
                logits = self.runner.forward(rows, token)[:, 0]
                rows = rows.advanced(1)
            if drawn is not None:
                masks.advance(j, drawn.wait().tolist(), batch_rows)
        return torch.cat(tokens, dim=1), torch.cat(probs, dim=1) if probs else None

    def _catch_up(self, seqs: list[Sequence], slots: list[int], num_tokens: list[int]) -> np.ndarray:
        """Feed tokens the draft has not seen (after a stretch with L = 0, or a prompt prefilled at
        L = 0), CATCH_UP_CHUNK a row per forward, in at most CATCH_UP_FORWARDS forwards: a row further
        behind goes on at the next step. Returns per row whether it is still more than two tokens behind
        (drafting starts from a short, bounded input)."""
        pool = self.runner.pool
        for forwards in itertools.count():
            lagging = np.subtract(num_tokens, pool.lengths[slots]) > 2
            if forwards == CATCH_UP_FORWARDS or not lagging.any():
                return lagging
            behind = np.flatnonzero(lagging).tolist()
            behind_slots = [slots[i] for i in behind]
            starts = pool.lengths[behind_slots].tolist()
            chunks = [seqs[i].token_ids[n : min(n + CATCH_UP_CHUNK, num_tokens[i] - 2)] for i, n in zip(behind, starts)]
            ids, last = pad_tokens(chunks, self.runner.device)
            pool.reserve(behind_slots, np.add(starts, [len(chunk) for chunk in chunks]))
            self.runner.forward(self.runner.rows(behind_slots, starts), ids, keep=last, prefill=True)
            pool.lengths[behind_slots] = np.add(starts, [len(chunk) for chunk in chunks])


def set_drafted_lengths(pool: "KVPool", slots: list[int], num_tokens, draft_lens) -> None:
    """After drafting n tokens from T committed: the draft cache was fed everything up to draft n - 1 (draft n
    was sampled but not fed). Set when the drafts are launched, or for drafts launched ahead of the step
    before them, once that step is read (EngineCore._finish_decode)."""
    pool.lengths[slots] = np.add(num_tokens, draft_lens) - 1


def _cat(tokens: list[torch.Tensor]) -> torch.Tensor | None:
    return torch.cat(tokens, dim=1) if tokens else None
