"""Decode lane: the draft model proposes up to L tokens for every active sequence, one batched
forward per drafted position."""

from dataclasses import dataclass

import torch

from lanes.batching import pad_tokens, to_device
from lanes.model_runner import ModelRunner
from lanes.sampling import STREAM_DRAFT, SamplingTensors, draw
from lanes.sequence import Sequence

CATCH_UP_CHUNK = 64  # tokens per catch-up forward for a sequence whose draft cache fell behind


@dataclass
class DraftProposal:
    """What travels from the decode lane to the verify lane: token ids and probabilities only."""

    tokens: torch.Tensor  # [B, L] int64, rows padded past their own length
    probs: torch.Tensor | None  # [B, L, V] the distribution q each token was drawn from; None when
    # every row is greedy (q is then one-hot at the token, and 4 bytes a token travel instead of 4 V)
    num_draft: torch.Tensor  # [B] int64 on the device

    @classmethod
    def empty(cls, batch: int, device) -> "DraftProposal":
        return cls(
            torch.zeros(batch, 0, dtype=torch.long, device=device),
            None,
            torch.zeros(batch, dtype=torch.long, device=device),
        )


class DraftLane:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def propose(self, seqs: list[Sequence], draft_lens: list[int]) -> DraftProposal:
        """Draft `draft_lens[i]` tokens for `seqs[i]` (0 allowed), sampling as each request asks."""
        batch, max_len = len(seqs), max(draft_lens, default=0)
        device = self.runner.device
        if max_len == 0:
            return DraftProposal.empty(batch, device)
        rows = [i for i, n in enumerate(draft_lens) if n > 0]
        sub = [seqs[i] for i in rows]
        self._catch_up(sub)
        index = to_device(rows, torch.long, device)
        st = SamplingTensors.build([s.params for s in sub], [s.seed for s in sub], device)
        tokens, probs = self._draft(sub, max_len, st)
        full_tokens = torch.zeros(batch, max_len, dtype=torch.long, device=device).index_copy_(0, index, tokens)
        full_probs = None
        if probs is not None:
            full_probs = torch.zeros(batch, max_len, probs.shape[-1], device=device).index_copy_(0, index, probs)
        for seq, n in zip(seqs, draft_lens):
            if n > 0:
                # Fed everything up to draft n - 1; draft n was sampled but not fed.
                self.runner.pool.lengths[seq.draft_slot] = len(seq.token_ids) + n - 1
        num_draft = to_device(draft_lens, torch.long, device)
        return DraftProposal(full_tokens, full_probs, num_draft)

    def _draft(self, seqs: list[Sequence], max_len: int, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
        pool = self.runner.pool
        slots = [s.draft_slot for s in seqs]
        kv_lens = [pool.lengths[slot] for slot in slots]
        pending = [s.token_ids[n:] for s, n in zip(seqs, kv_lens)]  # 1 or 2 tokens after catch-up
        ids, last = pad_tokens(pending, self.runner.device)
        # Absolute position of draft j of row b: len(token_ids) + j.
        base = to_device([len(s.token_ids) for s in seqs], torch.long, self.runner.device)[:, None]
        tokens, probs = [], []
        logits = self.runner.forward(slots, ids, kv_lens, keep=last)  # [B, V]
        kv_lens = [n + len(p) for n, p in zip(kv_lens, pending)]
        for j in range(max_len):
            token, q = draw(logits[:, None], st, base + j, STREAM_DRAFT)  # [B, 1], [B, 1, V] | None
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if j + 1 < max_len:
                logits = self.runner.forward(slots, token, kv_lens)[:, 0]
                kv_lens = [n + 1 for n in kv_lens]
        return torch.cat(tokens, dim=1), torch.cat(probs, dim=1) if probs else None  # [B, L], [B, L, V]

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Feed tokens the draft has not seen (after a stretch with L = 0) until at most two remain,
        so that drafting itself starts from a short, bounded input."""
        pool = self.runner.pool
        while True:
            behind = [s for s in seqs if len(s.token_ids) - pool.lengths[s.draft_slot] > 2]
            if not behind:
                return
            slots = [s.draft_slot for s in behind]
            starts = [pool.lengths[slot] for slot in slots]
            rows = [s.token_ids[n : min(n + CATCH_UP_CHUNK, len(s.token_ids) - 2)] for s, n in zip(behind, starts)]
            ids, last = pad_tokens(rows, self.runner.device)
            self.runner.forward(slots, ids, starts, keep=last, prefill=True)
            for slot, n, row in zip(slots, starts, rows):
                pool.lengths[slot] = n + len(row)
