"""Penalties and constraints on the raw logits, lossless under speculation.

vLLM's definitions, in vLLM's order (its v1 sampler): min_tokens (EOS and the stop token ids at
-inf until the output is long enough) and logit_bias, then the repetition penalty (over the prompt
and the output: positive logits divided by it, negative ones multiplied, as HF and CTRL do), the
frequency penalty (times each token's count in the output) and the presence penalty (once per
token in the output). Temperature, min-p, top-k and top-p follow in lanes/sample/sampling.py. Logprobs
stay raw, before all of this (lanes/sample/logprobs.py).

Under speculation, column c of a verify row scores the position after c drafted tokens, where the
output is the committed tokens plus drafts[:c]: the counts, the presence mask and min_tokens'
count include those drafts (a cumulative count along the draft axis). The rejection rule then
compares the draft's q with this penalised p at every column, so the output follows the
penalised target whatever the draft proposed; the draft penalises its own proposals the same way
only to be accepted more often.

A batch in which no row uses any of this builds nothing: `PenaltyHistory.of` returns None, and
`Penalties.build(None)` too. Otherwise only the rows that use them carry a history (host lists,
all that travels to a remote verify lane) and get [P, V] tensors, from two host-to-device copies.
"""

from dataclasses import dataclass

import numpy as np
import torch

from lanes.device.batching import to_device
from lanes.engine.sequence import Sequence
from lanes.sample.params import ParamError, SamplingParams


@dataclass
class PenaltyHistory:
    """The committed tokens the penalties of a batch read, for its rows that use them (P of B)."""

    rows: list[int]  # [P] the batch rows that use penalties, ascending
    prompt_ids: list[np.ndarray]  # per row: its prompt's distinct tokens (with a repetition penalty; else empty)
    output_ids: list[list[int]]  # per row: its output so far (with a penalty that counts it; else [])
    num_output: list[int]  # per row: how many output tokens it has (min_tokens)

    @classmethod
    def of(cls, seqs: list[Sequence]) -> "PenaltyHistory | None":
        """The history of the rows of `seqs` that use penalties; None when no row does."""
        rows = [i for i, s in enumerate(seqs) if s.params.penalised]
        if not rows:
            return None
        prompt_ids, output_ids, num_output = [], [], []
        for i in rows:
            seq, params = seqs[i], seqs[i].params
            n = seq.num_prompt_tokens
            if params.repetition_penalty != 1 and seq.distinct_prompt_ids is None:
                seq.distinct_prompt_ids = np.unique(np.asarray(seq.prompt_ids, dtype=np.int32))  # once a request
            prompt_ids.append(seq.distinct_prompt_ids if params.repetition_penalty != 1 else _NONE)
            output_ids.append(seq.token_ids[n:] if params.counts_output else [])
            num_output.append(len(seq.token_ids) - n)
        return cls(rows, prompt_ids, output_ids, num_output)

    def select(self, rows: list[int]) -> "PenaltyHistory | None":
        """The history of a sub-batch made of these batch rows, in this order."""
        where = {row: i for i, row in enumerate(self.rows)}
        picked = [(new, where[row]) for new, row in enumerate(rows) if row in where]
        if not picked:
            return None
        return PenaltyHistory([new for new, _ in picked], [self.prompt_ids[i] for _, i in picked],
                              [self.output_ids[i] for _, i in picked], [self.num_output[i] for _, i in picked])

    @staticmethod
    def merge(parts: list["PenaltyHistory | None"], num_rows: list[int]) -> "PenaltyHistory | None":
        """The history of batches stacked in order (`num_rows`: each batch's rows)."""
        merged, offset = PenaltyHistory([], [], [], []), 0
        for part, n in zip(parts, num_rows):
            if part is not None:
                merged.rows += [offset + row for row in part.rows]
                merged.prompt_ids += part.prompt_ids
                merged.output_ids += part.output_ids
                merged.num_output += part.num_output
            offset += n
        return merged if merged.rows else None


def check_request(params: SamplingParams, vocab_size: int, eos_ids: set[int]) -> None:
    """What only the engine can check or resolve: bias ids in the vocabulary, and the ids min_tokens
    holds back (stop_token_ids, plus EOS unless ignore_eos, as vLLM's all_stop_token_ids)."""
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ParamError("logit_bias", f"token ids must be in [0, {vocab_size})")
    if params.min_tokens > 0:
        params.min_tokens_stop_ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids))


@dataclass
class Penalties:
    """A batch's penalties on the device, for its P rows that use them. Features no row uses are None."""

    rows: torch.Tensor  # [P] int64 batch rows
    repetition: torch.Tensor  # [P] float32, 1 = off
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    output_counts: torch.Tensor | None  # [P, V] float32 committed output tokens, counted
    prompt_mask: torch.Tensor | None  # [P, V] bool, tokens in the prompt (repetition penalty)
    bias: torch.Tensor | None  # [P, V] float32 logit_bias
    owed: torch.Tensor | None  # [P] int64 output tokens still owed before a stop id may be sampled
    stop_mask: torch.Tensor | None  # [P, V] bool, the ids min_tokens holds back

    @classmethod
    def build(cls, params: list[SamplingParams], history: PenaltyHistory | None, vocab: int, device
              ) -> "Penalties | None":
        if history is None:
            return None
        ps = [params[r] for r in history.rows]
        num = len(ps)
        owed = [max(0, p.min_tokens - n) for p, n in zip(ps, history.num_output)]
        counting = any(p.counts_output for p in ps)
        repeating = any(p.repetition_penalty != 1 for p in ps)
        biased = any(p.logit_bias for p in ps)
        holding = any(owed)
        # Every id list flattened to indices into a [P * V] tensor: one int64 and one float32 copy.
        output_flat = _flat(history.output_ids if counting else [], vocab)
        prompt_flat = _flat(history.prompt_ids if repeating else [], vocab)
        bias_ids = _flat([list(p.logit_bias or {}) for p in ps] if biased else [], vocab)
        stop_flat = _flat([p.min_tokens_stop_ids if n else [] for p, n in zip(ps, owed)] if holding else [], vocab)
        longs = to_device(np.concatenate([np.asarray(history.rows + owed, dtype=np.int64), output_flat, prompt_flat,
                                          bias_ids, stop_flat]), torch.long, device)
        bias_values = [b for p in ps for b in (p.logit_bias or {}).values()] if biased else []
        floats = to_device([p.repetition_penalty for p in ps] + [p.presence_penalty for p in ps]
                           + [p.frequency_penalty for p in ps] + bias_values, torch.float32, device)
        rows, owed_t, output_i, prompt_i, bias_i, stop_i = longs.split(
            [num, num, len(output_flat), len(prompt_flat), len(bias_ids), len(stop_flat)])
        repetition, presence, frequency, bias_v = floats.split([num, num, num, len(bias_values)])
        size = num * vocab

        def dense(index: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
            if values is None:  # a mask
                return torch.zeros(size, dtype=torch.bool, device=device).index_fill_(0, index, True).view(num, vocab)
            return torch.zeros(size, dtype=torch.float32, device=device).index_add_(0, index, values).view(num, vocab)

        return cls(
            rows, repetition, presence, frequency,
            output_counts=dense(output_i, torch.ones_like(output_i, dtype=torch.float32)) if counting else None,
            prompt_mask=dense(prompt_i) if repeating else None,
            bias=dense(bias_i, bias_v) if biased else None,
            owed=owed_t if holding else None,
            stop_mask=dense(stop_i) if holding else None,
        )

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
        """Penalised copy of `logits` [B, K, V] (other rows unchanged, in at least float32).

        Column c of row b is the position after `first + c` drafts of `drafts` [B, D] (>= first + K - 1
        columns): the output there is the committed one plus drafts[b, :first + c]."""
        assert logits.dim() == 3, logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        sub = logits.index_select(0, self.rows).to(dtype)  # [P, K, V]
        width = sub.shape[1]
        if self.stop_mask is not None:
            column = first + torch.arange(width, device=sub.device)  # drafted output before each column
            holding = (column[None, :] < self.owed[:, None])[..., None] & self.stop_mask[:, None, :]  # [P, K, V]
            sub = sub.masked_fill(holding, float("-inf"))
        if self.bias is not None:
            sub = sub + self.bias[:, None, :].to(dtype)
        if self.output_counts is not None:
            counts = self._counts(drafts, first, width).to(dtype)  # [P, K, V]
            seen = counts > 0
            if self.prompt_mask is not None:
                factor = torch.where(seen | self.prompt_mask[:, None, :], self.repetition[:, None, None].to(dtype), 1.0)
                sub = torch.where(sub > 0, sub / factor, sub * factor)
            sub = sub - self.frequency[:, None, None].to(dtype) * counts - self.presence[:, None, None].to(dtype) * seen
        return logits.to(dtype).index_copy(0, self.rows, sub)

    def _counts(self, drafts: torch.Tensor | None, first: int, width: int) -> torch.Tensor:
        """[P, K, V]: the committed output's counts plus, at column c, drafts[:, :first + c]."""
        num, vocab = self.output_counts.shape
        if drafts is None or drafts.shape[1] == 0 or first + width <= 1:
            return self.output_counts[:, None, :].expand(num, width, vocab)
        mine = drafts.index_select(0, self.rows).clamp_min(0)  # [P, D]; padding past a row's drafts is
        # counted only at columns nothing reads (past num_draft)
        columns, drafted = torch.arange(width, device=mine.device), torch.arange(mine.shape[1], device=mine.device)
        before = first + columns[:, None] > drafted  # [K, D]: draft j precedes column c
        counts = self.output_counts[:, None, :].repeat(1, width, 1)  # a copy: the committed counts stay as built
        return counts.scatter_add_(2, mine[:, None, :].expand(-1, width, -1),
                                   before.to(counts.dtype)[None].expand(num, -1, -1))


_NONE = np.zeros(0, dtype=np.int32)


def _flat(ids: list[list[int]] | list[np.ndarray], vocab: int) -> np.ndarray:
    """Row i's ids as indices into a flattened [rows, vocab] tensor, all rows concatenated."""
    parts = [np.asarray(row, dtype=np.int64) + i * vocab for i, row in enumerate(ids) if len(row)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
