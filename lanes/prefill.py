"""Prefill lane: write prompt chunks of many requests into both models' caches in one forward each."""

from dataclasses import dataclass

import torch

from lanes.batching import pad_tokens, to_device
from lanes.model_runner import ModelRunner
from lanes.sampling import STREAM_TARGET, SamplingTensors, draw
from lanes.sequence import Sequence


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # first prompt position in this chunk
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.seq.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.prompt_ids[self.start : self.start + self.length]


def plan_chunks(seqs: list[Sequence], budget_tokens: int) -> list[PrefillChunk]:
    """Next prompt chunks, in order, until the token budget of one forward is spent."""
    chunks = []
    for seq in seqs:
        if budget_tokens <= 0:
            break
        length = min(budget_tokens, seq.num_prompt_tokens - seq.num_prefilled)
        chunks.append(PrefillChunk(seq, seq.num_prefilled, length))
        budget_tokens -= length
    return chunks


def plan_whole_prompts(seqs: list[Sequence], budget_tokens: int) -> list[PrefillChunk]:
    """Whole prompts that fit the token budget of one forward, first fit in order.

    Rows that all start at position 0 need no attention mask (flash attention, lanes/attention.py);
    a split prompt's second chunk would bring the mask back for its whole forward. Only a prompt
    longer than the budget is split, and its chunks run alone.
    """
    chunks = []
    for seq in seqs:
        left = seq.num_prompt_tokens - seq.num_prefilled
        if seq.num_prefilled > 0 or left > budget_tokens:
            if not chunks:
                return [PrefillChunk(seq, seq.num_prefilled, min(left, budget_tokens))]
            continue
        chunks.append(PrefillChunk(seq, 0, left))
        budget_tokens -= left
    return chunks


class PrefillLane:
    def __init__(self, target: ModelRunner, draft: ModelRunner | None):
        self.target = target
        self.draft = draft

    def run(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """Prefill `chunks`; return the target's first output token per row [B] (meaningful only
        for rows whose chunk completes the prompt). Stays on the device."""
        together, alone = self._fit(chunks)
        if not alone:
            return self._run(chunks)
        first: dict[int, torch.Tensor] = {}
        for group in ([together] if together else []) + [[c] for c in alone]:
            first.update(zip(map(id, group), self._run(group)))
        return torch.stack([first[id(c)] for c in chunks])

    def _fit(self, chunks: list[PrefillChunk]) -> tuple[list[PrefillChunk], list[PrefillChunk]]:
        """Rows of one forward are padded to its widest chunk, and the padding is written to the
        cache too. A continuing chunk whose padded write would pass its slot's end runs alone
        (unpadded), so slots need room for a prompt plus a draft, not plus a whole prefill budget."""
        width = max(c.length for c in chunks)
        capacity = self.target.pool.shape.capacity_tokens
        fits = [c for c in chunks if c.start + width <= capacity]
        return fits, [c for c in chunks if c.start + width > capacity]

    def _run(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        st = SamplingTensors.build([c.seq.params for c in chunks], [c.seq.seed for c in chunks], self.target.device)
        rows = [c.token_ids for c in chunks]
        starts = [c.start for c in chunks]
        ids, last = pad_tokens(rows, self.target.device)
        if self.draft is not None:
            self._write(self.draft, [c.seq.draft_slot for c in chunks], ids, starts, chunks, last)
        logits = self._write(self.target, [c.seq.target_slot for c in chunks], ids, starts, chunks, last)
        # The first output token sits at absolute position len(prompt).
        positions = to_device([[c.seq.num_prompt_tokens] for c in chunks], torch.long, logits.device)
        return draw(logits[:, None], st, positions, STREAM_TARGET)[0][:, 0]

    @staticmethod
    def _write(runner: ModelRunner, slots: list[int], ids, starts: list[int], chunks, last) -> torch.Tensor:
        logits = runner.forward(runner.rows(slots, starts), ids, keep=last, prefill=True)  # [B, V]
        for slot, chunk in zip(slots, chunks):
            runner.pool.lengths[slot] = chunk.start + chunk.length
        return logits
