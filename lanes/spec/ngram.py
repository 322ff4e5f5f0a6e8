"""Decode lane without a draft model: n-gram prompt lookup (vLLM's `ngram` method).

For each sequence, the longest suffix n-gram (prompt_lookup_max >= n >= prompt_lookup_min) of its
tokens (prompt + output) that occurred earlier in them is looked up, and the tokens that followed
its most recent earlier occurrence are proposed. Code, retrieval and editing outputs copy their
prompts, so such proposals are often right; where nothing matches, the row drafts nothing.

The proposal is deterministic, so its q is a point mass at each drafted token (`probs=None`): the
rejection rule then accepts a draft x with probability p(x) and on rejection samples
norm(max(p - one_hot(x), 0)), and the output keeps the target's distribution.

The search runs on the host, where the token ids already are, over the whole batch at once: one
pass of array comparisons per n-gram length, no Python loop over tokens, no device work. Rows whose
last prompt_lookup_min tokens never occurred before cannot match, and skip it: each sequence keeps an
index of where its n-grams of that length first end (`NgramIndex`), extended by the few tokens a step
appends. On random prompts, where nothing matches, the n-gram engine's step took 0.18 ms longer than
nospec's on an H200 before this (5.12 against 4.94 ms at 1 in flight, engine in process).
"""

import numpy as np
import torch

from lanes.engine.sequence import Sequence
from lanes.spec.draft import DraftProposal

PAD = -1  # left padding of the token matrix; never equal to a token id


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, device: str | torch.device = "cpu"):
        assert 1 <= prompt_lookup_min <= prompt_lookup_max, (prompt_lookup_min, prompt_lookup_max)
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.device = torch.device(device)

    def propose(self, seqs: list[Sequence], draft_lens: list[int]) -> DraftProposal:
        """Up to `draft_lens[i]` looked-up tokens for `seqs[i]`; `num_draft` says how many each row got."""
        batch, max_len = len(seqs), max(draft_lens, default=0)
        if max_len == 0:
            return DraftProposal.empty(batch, self.device)
        lens = np.asarray(draft_lens, dtype=np.int64)
        rows = np.asarray([i for i in np.flatnonzero(lens).tolist() if self._may_match(seqs[i])], dtype=np.int64)
        if rows.size == 0:  # nothing can match: the verify step is the one-token forward of no speculation
            return DraftProposal.empty(batch, self.device)
        tokens = right_aligned([seqs[i].lookup_index.array() for i in rows])  # [B', W]
        drafted, counts = lookup(tokens, lens[rows], self.min_n, self.max_n, max_len)  # [B', L], [B']
        # The batch is verified over as many columns as its longest proposal, not as were asked for: where
        # nothing matched, the verify step is the one-token forward of no speculation. On an H200 the padded
        # four-token verify of unmatched rows ran at 0.947x nospec at 1 in flight.
        width = int(counts.max(initial=0))
        full = np.zeros((batch, width), dtype=np.int64)
        full[rows] = drafted[:, :width]
        num_draft = np.zeros(batch, dtype=np.int64)
        num_draft[rows] = counts
        return DraftProposal(torch.from_numpy(full).to(self.device), None, num_draft.tolist())

    def _may_match(self, seq: Sequence) -> bool:
        index = seq.lookup_index
        if index is None or index.n != self.min_n:
            index = seq.lookup_index = NgramIndex(self.min_n)
        return index.may_match(seq.token_ids)


class NgramIndex:
    """A sequence's tokens as a numpy array, and where each of their n-grams first ends, for one n. A
    sequence's tokens only grow (rejected drafts never reach them, a preemption keeps them), so each
    call takes in only the tokens appended since the last (with the index, a step at 16 rows of 1,700
    matching tokens went from 0.71 to 0.32 ms on the 2-core CPU: docs/diagnoses.md, host_costs)."""

    def __init__(self, n: int):
        self.n = n
        self.first_end: dict[tuple[int, ...], int] = {}
        self.buffer = np.empty(256, dtype=np.int64)
        self.indexed = 0  # tokens taken in: in `buffer`, and n-grams ending before this position in first_end

    def may_match(self, tokens: list[int]) -> bool:
        """Whether the last n tokens occurred earlier, ending before the last position (so that a token
        follows them): without that, no n-gram of length >= n matches."""
        n = self.n
        if len(tokens) < self.indexed:  # never expected (tokens only grow); start over rather than be wrong
            self.first_end, self.indexed = {}, 0
        for end in range(max(self.indexed, n - 1), len(tokens)):
            self.first_end.setdefault(tuple(tokens[end - n + 1 : end + 1]), end)
        self._take(tokens)
        return len(tokens) > n and self.first_end[tuple(tokens[-n:])] < len(tokens) - 1

    def array(self) -> np.ndarray:
        """The tokens taken in so far, [len] int64 (a view: valid until the next `may_match`)."""
        return self.buffer[: self.indexed]

    def _take(self, tokens: list[int]) -> None:
        if len(tokens) > len(self.buffer):
            grown = np.empty(max(len(tokens), 2 * len(self.buffer)), dtype=np.int64)
            grown[: self.indexed] = self.buffer[: self.indexed]
            self.buffer = grown
        self.buffer[self.indexed : len(tokens)] = tokens[self.indexed :]
        self.indexed = len(tokens)


def right_aligned(rows: list[np.ndarray | list[int]]) -> np.ndarray:
    """[B, W] int64: each row's tokens at its right end, PAD before them (W = the longest row)."""
    width = max(map(len, rows))
    out = np.full((len(rows), width), PAD, dtype=np.int64)
    for i, ids in enumerate(rows):
        out[i, width - len(ids):] = ids
    return out


def lookup(tokens: np.ndarray, draft_lens: np.ndarray, min_n: int, max_n: int, max_len: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """Prompt lookup for every row of `tokens` [B, W] (right-aligned, PAD-padded).

    Returns drafts [B, max_len] (0 past a row's count, so every id can go through an embedding)
    and counts [B]: min(draft_lens, tokens after the match) where an n-gram of length >= min_n
    matched, else 0.
    """
    batch, width = tokens.shape
    assert draft_lens.shape == (batch,) and width >= 1
    # run[b, j]: how many tokens ending at position j equal the row's last tokens (up to max_n).
    # j stops at W - 2, so a match is never the suffix itself and has a token after it to propose.
    ends = width - 1
    run = np.zeros((batch, ends), dtype=np.int64)
    alive = np.ones((batch, ends), dtype=bool)
    for k in range(min(max_n, ends)):
        suffix_token = tokens[:, width - 1 - k]  # [B]; PAD where the row is shorter than k + 1
        eq = np.zeros((batch, ends), dtype=bool)
        eq[:, k:] = (tokens[:, : ends - k] == suffix_token[:, None]) & (suffix_token[:, None] != PAD)
        alive &= eq
        run += alive
    longest = run.max(axis=1, initial=0)  # [B]
    # The most recent occurrence among the longest: the last j whose run reaches it.
    last = ends - 1 - np.argmax((run == longest[:, None])[:, ::-1], axis=1) if ends else np.zeros(batch, np.int64)
    start = last + 1  # [B] first token to propose
    counts = np.where(longest >= min_n, np.minimum(draft_lens, width - start), 0)  # [B]
    columns = np.arange(max_len)
    index = np.minimum(start[:, None] + columns, width - 1)  # [B, L]
    drafts = np.take_along_axis(tokens, index, axis=1)
    return np.where(columns < counts[:, None], drafts, 0), counts
