"""Prefill lane: write prompt chunks of many requests into both models' caches in one forward each."""

from dataclasses import dataclass

import torch

from lanes.device.batching import pad_rows, pad_tokens, to_device
from lanes.engine.sequence import Sequence
from lanes.model.runner import ModelRunner
from lanes.sample.grammar import mask_first_tokens
from lanes.sample.logprobs import TokenLogprobs, batch_k, pack, unpack
from lanes.sample.penalties import Penalties, PenaltyHistory
from lanes.sample.sampling import STREAM_TARGET, SamplingTensors, draw


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # first prompt position in this chunk
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.seq.num_prefill_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.length]


def plan_chunks(seqs: list[Sequence], budget_tokens: int) -> list[PrefillChunk]:
    """Next prompt chunks, in order, while the forward's padded size (rows x its widest chunk, what
    its activations take) stays within the token budget: a chunk is cut to fit, and none is added
    once the rows so far are too wide for one more."""
    chunks, width = [], 0
    for seq in seqs:
        cap = budget_tokens // (len(chunks) + 1)  # the widest a row may be with one more row
        if cap < max(width, 1):
            break
        length = min(cap, seq.num_prefill_tokens - seq.num_prefilled)
        chunks.append(PrefillChunk(seq, seq.num_prefilled, length))
        width = max(width, length)
    return chunks


def plan_whole_prompts(seqs: list[Sequence], budget_tokens: int) -> list[PrefillChunk]:
    """Whole prompts that fit the token budget of one forward, first fit in order.

    Rows that all start at position 0 need no attention mask (flash attention, lanes/model/attention.py);
    a split prompt's second chunk would bring the mask back for its whole forward. Only a prompt
    longer than the budget is split, and its chunks run alone. The budget bounds the forward's
    padded size (rows x its widest prompt), which is what its activations take: the lane's memory
    profile measured one forward of `budget_tokens` (lanes/model/memory_profile.py).
    """
    chunks, width = [], 0
    for seq in seqs:
        left = seq.num_prefill_tokens - seq.num_prefilled
        if seq.num_prefilled > 0 or left > budget_tokens:
            if not chunks:
                return [PrefillChunk(seq, seq.num_prefilled, min(left, budget_tokens))]
            continue
        if (len(chunks) + 1) * max(width, left) > budget_tokens:
            continue
        chunks.append(PrefillChunk(seq, 0, left))
        width = max(width, left)
    return chunks


class PrefillLane:
    def __init__(self, target: ModelRunner, draft: ModelRunner | None, lazy_draft: bool = False):
        """`lazy_draft`: write the draft's KV only for rows that draft (L > 0). A request admitted
        while the controller has speculation off then costs what it costs without a draft model, and
        if L comes back the draft's catch-up (lanes/spec/draft.py) writes what it skipped. The
        engine's own prefill is lazy; a prefill lane of its own (lanes/spec/prompt_prefiller.py) hands
        both caches over whole, so it is not."""
        self.target = target
        self.draft = draft
        self.lazy_draft = lazy_draft

    def run(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """Prefill `chunks`; return per row the target's first output token (meaningful only for rows
        whose chunk completes the prompt), then the logprobs the rows asked for, packed as
        `PrefillLogprobs.of(chunks)` reads them: int64 [B, 1 + packed]. Stays on the device."""
        layout = PrefillLogprobs.of(chunks)
        together, alone = self._fit(chunks)
        if not alone:
            return self._run(chunks, layout)
        first: dict[int, torch.Tensor] = {}
        for group in ([together] if together else []) + [[c] for c in alone]:
            first.update(zip(map(id, group), self._run(group, layout)))
        # Groups differ in width when they pack every position's logprobs: pad to the widest.
        width = max(row.shape[0] for row in first.values())
        return torch.stack([torch.nn.functional.pad(first[id(c)], (0, width - first[id(c)].shape[0])) for c in chunks])

    def _fit(self, chunks: list[PrefillChunk]) -> tuple[list[PrefillChunk], list[PrefillChunk]]:
        """Rows of one forward are padded to its widest chunk, and the padding is written to the
        cache too. A continuing chunk whose padded write would pass its slot's end runs alone
        (unpadded), so slots need room for a prompt plus a draft, not plus a whole prefill budget."""
        width = max(c.length for c in chunks)
        capacity = self.target.pool.shape.capacity_tokens
        fits = [c for c in chunks if c.start + width <= capacity]
        return fits, [c for c in chunks if c.start + width > capacity]

    def _run(self, chunks: list[PrefillChunk], layout: "PrefillLogprobs") -> torch.Tensor:
        st = SamplingTensors.build([c.seq.params for c in chunks], [c.seq.seed for c in chunks], self.target.device)
        rows = [c.token_ids for c in chunks]
        starts = [c.start for c in chunks]
        ids, last = pad_tokens(rows, self.target.device)
        self._write_draft(chunks, ids, last)
        # Prompt logprobs need the logits of every position; otherwise only each row's last.
        keep = None if layout.every_position else last
        logits = self.write(self.target, [c.seq.target_slot for c in chunks], ids, starts, chunks, keep)
        last_logits = logits[torch.arange(len(chunks), device=logits.device), last] if keep is None else logits  # [B, V]
        last_logits = mask_first_tokens(last_logits, [c.seq for c in chunks])  # rows with a grammar, else as is
        # The first output token sits at absolute position len(prompt).
        positions = to_device([[c.seq.num_prefill_tokens] for c in chunks], torch.long, logits.device)
        penalties = Penalties.build([c.seq.params for c in chunks], PenaltyHistory.of([c.seq for c in chunks]),
                                    logits.shape[-1], logits.device)
        # Logprobs (below) stay raw: penalties only change what is sampled.
        scores = last_logits[:, None] if penalties is None else penalties.apply(last_logits[:, None])
        first = draw(scores, st, positions, STREAM_TARGET)[0]  # [B, 1]
        if layout.k is None:
            return first
        if not layout.every_position:
            return torch.cat([first, pack(last_logits[:, None], first, layout.k)], dim=1)
        # Position j's logits score the token after it: the next prompt token, or after a prompt's
        # last token the first output token (marked -1 on the host, filled in here).
        following = to_device(pad_rows([_following(c) for c in chunks])[0], torch.long, logits.device)  # [B, Q]
        following = torch.where(following < 0, first, following)
        return torch.cat([first, pack(logits, following, layout.k)], dim=1)

    def _write_draft(self, chunks: list[PrefillChunk], ids: torch.Tensor, last: torch.Tensor) -> None:
        """The draft's KV of the chunks whose rows draft, from the batch's padded `ids` where that is all of them."""
        if self.draft is None:
            return
        drafting = [c for c in chunks if self._drafts(c)]
        if len(drafting) < len(chunks) and drafting:
            ids, last = pad_tokens([c.token_ids for c in drafting], self.draft.device)
        if drafting:
            self.write(self.draft, [c.seq.draft_slot for c in drafting], ids, [c.start for c in drafting],
                        drafting, last)

    def _drafts(self, chunk: PrefillChunk) -> bool:
        """Whether the draft's KV of this chunk is written now: always, unless lazy; when lazy, where
        the row drafts and its draft KV reaches the chunk's start (a row whose draft KV lags, after a
        stretch at L = 0 or a shorter cached prefix, is left to the catch-up)."""
        if not self.lazy_draft:
            return True
        return chunk.seq.draft_len > 0 and int(self.draft.pool.lengths[chunk.seq.draft_slot]) == chunk.start

    @staticmethod
    def write(runner: ModelRunner, slots: list[int], ids, starts: list[int], chunks, keep) -> torch.Tensor:
        """One forward of `runner` that writes the chunks' KV into `slots` (padded `ids`, [B, Q]); returns
        the logits of the positions `keep` names (None: every position)."""
        runner.pool.reserve(slots, [c.start + c.length for c in chunks])
        logits = runner.forward(runner.rows(slots, starts), ids, keep=keep, prefill=True)  # [B, V] or [B, Q, V]
        for slot, chunk in zip(slots, chunks):
            runner.pool.lengths[slot] = chunk.start + chunk.length
        return logits


def _following(chunk: PrefillChunk) -> list[int]:
    """The token each of the chunk's positions predicts: the next prompt token, -1 for the output's first."""
    start, end = chunk.start + 1, chunk.start + chunk.length + 1
    return chunk.seq.token_ids[start:end] + ([-1] if chunk.completes_prompt else [])


@dataclass(frozen=True)
class PrefillLogprobs:
    """Where `PrefillLane.run` put the logprobs its rows asked for, after the first token (column 0)."""

    k: int | None  # top-k packed per position (the batch's largest); None: nothing packed
    every_position: bool  # every position of the chunk (some row wants prompt logprobs), else its last only

    @classmethod
    def of(cls, chunks: list[PrefillChunk]) -> "PrefillLogprobs":
        params = [c.seq.params for c in chunks]
        prompt_k = [p.prompt_logprobs for p in params]
        return cls(batch_k([p.logprobs for p in params] + prompt_k), batch_k(prompt_k) is not None)

    def first_token(self, chunk: PrefillChunk, row: torch.Tensor) -> TokenLogprobs | None:
        """The first output token's logprobs, from a host row of `run`, for a chunk that completes its prompt."""
        want = chunk.seq.params.logprobs
        if want is None:
            return None
        return unpack(row[1:], self.k, chunk.length - 1 if self.every_position else 0, 1, want)

    def prompt(self, chunk: PrefillChunk, row: torch.Tensor) -> TokenLogprobs | None:
        """Logprobs of the prompt tokens this chunk's positions predict (all but the output's first)."""
        want = chunk.seq.params.prompt_logprobs
        if want is None:
            return None
        return unpack(row[1:], self.k, 0, chunk.length - int(chunk.completes_prompt), want)
