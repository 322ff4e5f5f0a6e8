"""One record per submitted request: every request the load tester sends ends up as exactly one
`RequestRecord`, whatever happened to it, so counts in a summary always add up."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

Status = Literal["completed", "failed", "timed_out"]
STATUSES: tuple[Status, ...] = ("completed", "failed", "timed_out")


@dataclass
class RequestRecord:
    index: int  # position in the run's submission order
    kind: str  # workload kind: "normal" or "long"
    prompt_len: int  # tokens, by the workload's tokenizer
    output_len: int  # max_tokens asked for
    status: Status
    start_s: float  # submit time, seconds since the measured window opened
    end_s: float  # when the stream ended, failed or timed out, same clock
    ttft_ms: float | None = None  # None if no token arrived
    tpot_ms: float | None = None  # (e2e - ttft) / (completion_tokens - 1); None below 2 tokens
    itl_ms: list[float] = field(default_factory=list)  # gaps between successive token chunks
    completion_tokens: int = 0  # the server's usage count; chunks with text where it sent none
    prompt_tokens: int | None = None  # the server's usage count
    http_status: int | None = None
    error: str | None = None
    # This request's own spec-decode counts, from usage.spec_decode where the server sends them.
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    # To line the request up with the server's timelines: the response's id, and the wall-clock
    # time it was sent (its first token came ttft_ms later).
    response_id: str | None = None
    sent_wall_s: float | None = None

    @property
    def e2e_ms(self) -> float:
        return (self.end_s - self.start_s) * 1000.0

    def to_row(self) -> dict:
        """A flat dict for JSON and CSV, e2e_ms included."""
        return {**asdict(self), "e2e_ms": self.e2e_ms}
