"""Step-cost model: what one decode step costs as a function of the tokens it verifies, learned online
from the decode replicas' step totals, and the draft length that yields the most tokens per second under
it. Pure functions; no Ray.

Model. A decode step over n requests at draft length L runs L drafter forwards over the n rows and one
target forward over T = n (L + 1) tokens:

    step_ms(n, L) = t(n (L + 1)) + c L t(n),        t(T) = t0 + b T

t(T) is the target's forward over T tokens and c (`draft_cost_ratio`) the cost of a drafter forward relative
to the target's over the same rows. b = 0 is a memory-bound target: a step costs the same whatever it
verifies, drafted tokens ride along for free. b T >> t0 is a compute-bound one (a large batch on a large
model): a drafted token costs about what a generated one does, so rejected drafts are pure loss and
speculation is slower than none (why TensorRT-LLM turns it off by batch size).

Fit. Per step, step_ms = t0 (1 + c F) + b (T + c D), with F the drafter forwards and D = F n the draft
tokens: linear in (t0, b). Divided by x = 1 + c F it is a line, y / x = t0 + b z with z = (T + c D) / x,
fitted by least squares with weights `num_steps` x^2 (the same minimum as the undivided problem) over the
interval samples of the last `window_decisions` decisions.

Where the lanes measured the drafter (`DraftCost`, a line through its one-token forward at two batch
sizes, lanes/model/forward_cost.py), its time replaces c t(n): step_ms(n, L) = t(n (L + 1)) + L d(n). A
small drafter is bound by kernel launches and costs about the same at 16 rows and at 64, while c t(n)
grows with the target's forward: on an H200 (TinyLlama for a 7B target) that overstated the drafter by
~40 % at 92 rows and turned speculation off where L = 1 still paid (benchmarks/results/gpu_evidence_h200).
The fit then subtracts the drafter's measured time, d0 F + d1 D, from each sample and fits the target's
line to the rest: y = t0 + b z with y = (step_ms - d0 F - d1 D) / steps and z = T / steps.

Prefill beside decode. Unified launches a prefill chunk (up to `prefill_chunk_tokens` prompt tokens) in
most decode steps, and a step's wall time includes it. Charged to the verified tokens alone, that chunk
steepened unified's fitted slope to 0.06-0.08 ms a token against spec's 0.03-0.05 on the same H200 (spec
prefills in steps of its own, which verify nothing and are not counted), and the model turned speculation
off at 256 in flight where spec's kept L = 1 and gained (benchmarks/results/gpu_evidence_h200, fifth set). A
prompt token goes through the same weights as a verified one, so each sample's forward counts P prompt
tokens as well: z = (T + P) / steps. The decision leaves P out: the prompts to prefill are the same
whatever L is, so only the decode part of a step depends on L.

A window whose z hardly varies cannot tell the slope: at L = 0 under a steady load every step verifies the
same n tokens. There the slope of the previous fit carries over (b = 0 before the first fit: a step's cost
independent of L, what the policy assumed before this model): b = (S_zy + lam b_prev) / (S_zz + lam) with
lam = W (s z_mean)^2, so a window whose z has a standard deviation of s = `spread_frac` of its mean weighs
as much as the previous slope. Without this, speculation would be switched back on whenever a steady load
at L = 0 filled the window, only to learn the slope again at a loss.
"""

from dataclasses import dataclass

from controller.signals import StepTotals, expected_tokens_per_step


@dataclass(frozen=True)
class StepCost:
    """t(T) = t0_ms + slope_ms_per_token T: one target forward over T tokens."""

    t0_ms: float
    slope_ms_per_token: float

    def forward_ms(self, num_tokens: float) -> float:
        return self.t0_ms + self.slope_ms_per_token * num_tokens

    def step_ms(self, rows: float, draft_len: int, draft_cost_ratio: float, draft: "DraftCost | None" = None) -> float:
        """One decode step of `rows` requests at draft length L: the verify forward and L drafter forwards
        (each `draft`'s measured time where given, else c times the target's forward over the rows)."""
        drafter_ms = draft.forward_ms(rows) if draft is not None else draft_cost_ratio * self.forward_ms(rows)
        return self.forward_ms(rows * (draft_len + 1)) + draft_len * drafter_ms


@dataclass(frozen=True)
class DraftCost:
    """d(n) = t0_ms + slope_ms_per_row n: one drafter forward of one token over n rows, as measured."""

    t0_ms: float
    slope_ms_per_row: float

    def forward_ms(self, rows: float) -> float:
        return self.t0_ms + self.slope_ms_per_row * rows

    @classmethod
    def through(cls, points: dict[int, float]) -> "DraftCost":
        """The line through measurements {rows: ms} (flat through one), kept non-negative."""
        (n1, ms1), *rest = sorted(points.items())
        if not rest:
            return cls(ms1, 0.0)
        n2, ms2 = rest[-1]
        slope = max(0.0, (ms2 - ms1) / (n2 - n1))
        return cls(max(0.0, ms1 - slope * n1), slope)


@dataclass(frozen=True)
class StepCostModel:
    """The fit's state: the window of samples and the last fit (None before the first sample)."""

    samples: tuple[tuple[int, StepTotals], ...] = ()  # (decision index, one replica's interval totals)
    fit: StepCost | None = None
    # Whether some window so far had the spread to tell the slope itself (`window_tells_slope`); until then
    # the fit's slope is the prior's 0, a guess that may cap L but should not overrule the load signals.
    informed: bool = False


Point = tuple[float, float, float]  # (z, y / x, weight): one sample as a point of the line


def _line_point(totals: StepTotals, draft_cost_ratio: float, draft: DraftCost | None = None) -> Point:
    """(z, y / x, weight) of one sample: the step totals as one point of the line y / x = t0 + b z."""
    steps, c = totals.num_steps, draft_cost_ratio
    target_tokens = totals.rows + totals.draft_tokens + totals.prefill_tokens  # verified, and prompt tokens beside
    if draft is not None:  # the drafter's measured time out, the target's line from the rest (x = 1)
        drafter_ms = draft.t0_ms * totals.draft_forwards + draft.slope_ms_per_row * totals.draft_tokens
        return target_tokens / steps, (totals.step_ms - drafter_ms) / steps, float(steps)
    x = 1.0 + c * totals.draft_forwards / steps
    verify_tokens = target_tokens / steps
    z = (verify_tokens + c * totals.draft_tokens / steps) / x
    return z, totals.step_ms / steps / x, steps * x * x


def _points(samples: list[StepTotals], draft_cost_ratio: float, draft: DraftCost | None) -> list[Point]:
    return [_line_point(s, draft_cost_ratio, draft) for s in samples if s.num_steps > 0]


def _spread(points: list[Point], spread_frac: float) -> tuple[float, float, float, float]:
    """(total weight, weighted mean of z, S_zz, lam): the points' own spread in z, S_zz, and what the
    previous slope weighs against it in the fit, lam = W (spread_frac z_mean)^2."""
    weight = sum(w for _, _, w in points)
    z_mean = sum(w * z for z, _, w in points) / weight
    s_zz = sum(w * (z - z_mean) ** 2 for z, _, w in points)
    return weight, z_mean, s_zz, weight * (spread_frac * z_mean) ** 2


def _fit(points: list[Point], prev: StepCost | None, spread_frac: float) -> StepCost | None:
    if not points:
        return None
    weight, z_mean, s_zz, lam = _spread(points, spread_frac)
    y_mean = sum(w * y for _, y, w in points) / weight
    s_zy = sum(w * (z - z_mean) * (y - y_mean) for z, y, w in points)
    prev_slope = prev.slope_ms_per_token if prev is not None else 0.0
    # lam = 0 only when every z is 0, which no step (>= 1 verified token) produces; guarded anyway.
    slope = max(0.0, (s_zy + lam * prev_slope) / (s_zz + lam)) if s_zz + lam > 0 else prev_slope
    t0 = y_mean - slope * z_mean
    if t0 < 0:  # steeper than proportional: the best line through the origin instead
        t0 = 0.0
        slope = sum(w * z * y for z, y, w in points) / sum(w * z * z for z, _, w in points)
    return StepCost(t0, slope)


def fit_step_cost(
    samples: list[StepTotals], prev: StepCost | None, draft_cost_ratio: float, spread_frac: float,
    draft: DraftCost | None = None,
) -> StepCost | None:
    """Weighted least-squares line through the samples, its slope pulled toward `prev`'s (0 without one)
    as far as the samples lack spread; t0 and the slope are kept non-negative. None without samples."""
    return _fit(_points(samples, draft_cost_ratio, draft), prev, spread_frac)


def window_tells_slope(points: list[Point], spread_frac: float) -> bool:
    """Whether the points' own spread in z weighs at least as much as the previous slope in the fit
    (S_zz >= lam): a standard deviation of at least `spread_frac` of their mean."""
    if len(points) < 2:
        return False
    _, _, s_zz, lam = _spread(points, spread_frac)
    return s_zz >= lam


def observe_steps(
    model: StepCostModel,
    totals: list[StepTotals],
    decision_index: int,
    window_decisions: int,
    draft_cost_ratio: float,
    spread_frac: float,
    draft: DraftCost | None = None,
) -> StepCostModel:
    """Add this decision's samples, drop those older than the window, refit. An interval without steps
    leaves the fit as it was (an idle lane says nothing about the cost of a step)."""
    new = tuple((decision_index, t) for t in totals if t.num_steps > 0)
    if not new:
        return model
    samples = tuple(s for s in model.samples if decision_index - s[0] < window_decisions) + new
    points = _points([t for _, t in samples], draft_cost_ratio, draft)
    informed = model.informed or window_tells_slope(points, spread_frac)
    return StepCostModel(samples, _fit(points, model.fit, spread_frac), informed)


def tokens_per_s(cost: StepCost, rows: float, accept_rate: float, draft_len: int, draft_cost_ratio: float,
                 draft: DraftCost | None = None) -> float:
    """Expected output tokens per second of a verify batch of `rows` requests at draft length L."""
    tokens = rows * expected_tokens_per_step(accept_rate, draft_len)
    return 1e3 * tokens / cost.step_ms(rows, draft_len, draft_cost_ratio, draft)


def fastest_draft_len(
    cost: StepCost,
    rows: float,
    accept_rate: float,
    current: int,
    lo: int,
    hi: int,
    draft_cost_ratio: float,
    min_gain_frac: float,
    spec_min_gain_frac: float,
    draft: DraftCost | None = None,
) -> int:
    """The L in [lo, hi] with the most tokens per second at `rows` requests per verify batch. Among L > 0
    an in-bounds `current` is kept unless the best beats it by `min_gain_frac` (neighbouring L are often
    within 1 % of each other); L = 0 (when lo allows it) wins unless the best L > 0 beats it by
    `spec_min_gain_frac`: a margin for the model's error, so that speculation is on only where it pays."""
    def rate(draft_len: int) -> float:
        return tokens_per_s(cost, rows, accept_rate, draft_len, draft_cost_ratio, draft)

    best = max(range(max(lo, 1), hi + 1), key=rate)  # the shorter L on ties
    if max(lo, 1) <= current <= hi and rate(best) < (1.0 + min_gain_frac) * rate(current):
        best = current
    if lo == 0 and rate(best) < (1.0 + spec_min_gain_frac) * rate(0):
        return 0
    return best
