"""What the draft-length policy reads: one snapshot of the lanes per decision, and the arithmetic that
turns spec-decode counters into an acceptance rate. Pure data; no Ray.

Counter names follow vLLM's spec-decode metrics (`num_drafts`, `num_draft_tokens`,
`num_accepted_tokens`) so a dashboard built for one reads the other. "Acceptance rate" here is the
per-token acceptance probability a of Leviathan et al. 2023, not vLLM's accepted / drafted ratio (which
also depends on L); `estimate_acceptance_rate` converts.
"""

from dataclasses import dataclass, field

# 48 halvings of [0, 1] leave the acceptance rate within 4e-15, far below counting noise.
_BISECT_STEPS = 48


@dataclass(frozen=True)
class RequestDraftStats:
    """Spec-decode counters of one request since the previous snapshot (deltas, not running totals)."""

    num_drafts: int  # verify steps that carried a draft of this request
    num_draft_tokens: int  # draft tokens proposed in those steps
    num_accepted_tokens: int  # draft tokens the target accepted (the bonus token is not counted)

    def __post_init__(self) -> None:
        if min(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens) < 0:
            raise ValueError(f"negative spec-decode counter: {self}")
        if self.num_drafts > self.num_draft_tokens or (self.num_drafts == 0 and self.num_draft_tokens > 0):
            raise ValueError(f"every draft holds at least one token and tokens need a draft: {self}")
        if self.num_accepted_tokens > self.num_draft_tokens:
            raise ValueError(f"more accepted than drafted tokens: {self}")


@dataclass(frozen=True)
class StepTotals:
    """One decode replica's engine steps that verified a batch, summed over one interval (deltas of the
    replica's running totals): what the step-cost model (controller/cost_model.py) is fitted to."""

    num_steps: int
    step_ms: float  # their wall time: drafting, verification and any prefill chunk run in the same step
    rows: int  # requests verified, summed over the steps
    draft_tokens: int  # draft tokens verified, summed: a step verified rows + draft_tokens tokens
    # Drafter forwards, summed: per step the mean L of its rows that drafted (the drafter runs max L
    # forwards; the two agree when those rows share one L, as they do under one default L).
    draft_forwards: float
    # Prompt tokens of the prefill chunks launched in those steps (unified runs one beside most decode
    # steps; their time is in step_ms), summed.
    prefill_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.num_steps, self.step_ms, self.rows, self.draft_tokens, self.draft_forwards, self.prefill_tokens) < 0:
            raise ValueError(f"negative step total: {self}")
        if self.rows < self.num_steps:
            raise ValueError(f"every counted step verifies at least one row: {self}")


@dataclass(frozen=True)
class LaneSignals:
    """One snapshot of the lanes, assembled by the controller actor before each decision."""

    verify_queue_depth: int  # requests waiting for a slot in a verify batch
    verify_batch_occupancy: float  # mean fraction of the verify batch capacity in use, 0..1
    decode_step_p95_ms: float  # p95 latency of one decode-lane (draft) step
    arrival_rate_rps: float  # new requests per second at the ingress
    # Requests in flight (running + queued) per verify batch, for the busiest batch: what the next verify
    # batches will hold. It rises as soon as arrivals outrun completions, before a queue forms. 0 = unknown.
    requests_per_verify_batch: float = 0.0
    requests: dict[str, RequestDraftStats] = field(default_factory=dict)  # request id -> counter deltas
    step_totals: list[StepTotals] = field(default_factory=list)  # one per decode replica that stepped
    # The drafter's one-token forward, {rows: ms}, as the decode replicas measured it at start (median
    # over replicas); empty where none did (no drafter model, or replicas that do not report it).
    draft_forward_ms: dict[int, float] = field(default_factory=dict)
    # With `slo:` targets: the decode replicas' TTFT and TPOT p95, the larger over its target (max over
    # replicas); 0 = no targets or no requests. Over 1 with full batches, the target's compute is what keeps
    # the lanes from their targets: L is shed before the planner adds replicas (controller/planner.py).
    slo_pressure: float = 0.0

    def __post_init__(self) -> None:
        signals = (self.verify_queue_depth, self.decode_step_p95_ms, self.arrival_rate_rps,
                   self.requests_per_verify_batch, self.slo_pressure)
        if min(signals) < 0:
            raise ValueError(f"negative lane signal: {self}")
        if not 0.0 <= self.verify_batch_occupancy <= 1.0:
            raise ValueError(f"verify_batch_occupancy must lie in [0, 1], got {self.verify_batch_occupancy}")


def ewma(prev: float | None, sample: float, alpha: float) -> float:
    """Exponentially weighted moving average; the first sample seeds it."""
    if prev is None:
        return sample
    return alpha * sample + (1.0 - alpha) * prev


def expected_tokens_per_step(accept_rate: float, draft_len: float) -> float:
    """Tokens one verify step yields for a draft of `draft_len` tokens, each accepted with probability
    `accept_rate` independently: accepted prefix plus the target's own token,
    (1 - a^(L+1)) / (1 - a) (Leviathan et al. 2023, eq. 1). A real `draft_len` is allowed so that a mean
    draft length can be plugged in."""
    if accept_rate >= 1.0:
        return draft_len + 1.0
    return (1.0 - accept_rate ** (draft_len + 1.0)) / (1.0 - accept_rate)


def estimate_acceptance_rate(stats: RequestDraftStats) -> float | None:
    """Per-token acceptance rate a whose expected accepted prefix matches the observed one; None without
    drafts.

    accepted / drafted is not a: a draft stops at its first rejection, so with a = 0.8 and L = 8 only
    42% of the drafted tokens are accepted. Instead solve a (1 - a^L) / (1 - a) = mean accepted per draft
    for a, by bisection (the left side rises monotonically in a). L is the mean draft length of the
    window, exact when the request kept one L over the window.
    """
    if stats.num_drafts == 0:
        return None
    mean_draft_len = stats.num_draft_tokens / stats.num_drafts
    mean_accepted = stats.num_accepted_tokens / stats.num_drafts
    if mean_accepted >= mean_draft_len:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        if expected_tokens_per_step(mid, mean_draft_len) - 1.0 < mean_accepted:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
