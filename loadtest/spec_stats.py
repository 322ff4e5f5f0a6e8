"""Spec-decode acceptance over a run, from the server's counters (`GET /v1/spec_decode/stats`).

The counters are totals since the server started, so a run reads them before and after its
measured part and reports the difference, with vLLM's definitions:
acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodeCounters:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]

    @classmethod
    def from_json(cls, body: dict) -> SpecDecodeCounters:
        return cls(num_drafts=int(body["num_drafts"]),
                   num_draft_tokens=int(body["num_draft_tokens"]),
                   num_accepted_tokens=int(body["num_accepted_tokens"]),
                   num_accepted_tokens_per_pos=[int(n) for n in
                                                body.get("num_accepted_tokens_per_pos", [])])

    def minus(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        # The draft length can grow during a run, so the later list may be longer.
        width = max(len(self.num_accepted_tokens_per_pos),
                    len(before.num_accepted_tokens_per_pos))
        after_pos = _padded(self.num_accepted_tokens_per_pos, width)
        before_pos = _padded(before.num_accepted_tokens_per_pos, width)
        return SpecDecodeCounters(
            num_drafts=self.num_drafts - before.num_drafts,
            num_draft_tokens=self.num_draft_tokens - before.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - before.num_accepted_tokens,
            num_accepted_tokens_per_pos=[a - b for a, b in zip(after_pos, before_pos)])


def _padded(values: list[int], width: int) -> list[int]:
    return values + [0] * (width - len(values))


@dataclass(frozen=True)
class SpecDecodeSummary:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float | None  # None when no draft token was proposed (e.g. nospec)
    mean_acceptance_length: float | None
    acceptance_rate_per_pos: list[float]  # accepted at position i / drafts


def summarize_spec(before: SpecDecodeCounters, after: SpecDecodeCounters) -> SpecDecodeSummary:
    delta = after.minus(before)
    drafts = delta.num_drafts
    return SpecDecodeSummary(
        num_drafts=drafts,
        num_draft_tokens=delta.num_draft_tokens,
        num_accepted_tokens=delta.num_accepted_tokens,
        acceptance_rate=(delta.num_accepted_tokens / delta.num_draft_tokens
                         if delta.num_draft_tokens > 0 else None),
        mean_acceptance_length=1 + delta.num_accepted_tokens / drafts if drafts > 0 else None,
        acceptance_rate_per_pos=[n / drafts for n in delta.num_accepted_tokens_per_pos]
        if drafts > 0 else [])
