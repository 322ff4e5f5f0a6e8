"""Draft-length policy: `decide(state, signals, config) -> (state, decision)`, a pure function the
controller actor calls once every `config.interval_s`.

What it decides
    - a default draft length L (used for every request a replica has no per-request L for, and the cap of
      all per-request L): driven to `min_draft_len` (0 = speculation off) while the lanes saturate (where
      the step-cost model below has learnt its slope and the saturation is a verify queue, only down to
      the L it makes fastest), raised while there is headroom (or, with that model, room in the decode
      p95) and the fleet's acceptance pays for it, up to the longest L that any
      request's acceptance rate justifies, and never above a load cap: the longest L whose verify batches,
      with the requests now in flight, stay within `verify_token_budget` tokens; nor above the cost cap:
      the L with the most expected tokens per second under a step-cost model fitted online to the
      replicas' step times (controller/cost_model.py), 0 where verification is so compute-bound that no
      L > 0 beats speculation off by `spec_min_gain_frac`;
    - a per-request L: the L that maximises expected tokens per unit cost for that request's acceptance
      rate, capped by the default, so requests whose drafts keep failing get shorter drafts.
    Every L moves at most `max_step` per decision, and only after `raise_dwell` / `lower_dwell`
    consecutive decisions point the same way; queue, acceptance and load-cap thresholds come in low/high
    pairs. Load is shed faster than it is taken: a default L above the load cap falls to it in one move
    (after `lower_dwell`), a decode p95 beyond `shed_margin_frac` over its target cuts it at once in
    proportion, and a per-request L above the default falls to it at once; rises stay stepped. The cost
    cap moves L with the usual dwell and steps: it is about throughput, not latency.

How the controller actor applies it (controller/actor.py)
    Decode replicas (DecodeLane) expose:
        stats() -> dict with running totals: per request in flight its draft_len and cumulative
            num_drafts, num_draft_tokens, num_accepted_tokens; waiting / prefilling / running counts,
            max_num_seqs, num_arrivals, step_p95_ms; step_totals (the replica's verifying steps: their
            number, time, rows, draft tokens and drafter forwards)
        set_draft_lengths(default_len: int, per_request: dict[str, int]) -> None
            (a request missing from `per_request` runs at `default_len`)
    Each decision the actor:
        1. broadcasts stats() to every decode replica (and the verify lane in pdv), turns the running
           totals into per-interval deltas, and merges them into one `LaneSignals`: decode p95 = max
           over replicas (the slowest replica bounds the latency target), arrival rate from the arrival
           counts, requests per verify batch = running + queued of the busiest replica (pdv: of all, per
           verify replica), requests = union (a request lives on one decode replica), step totals = one
           per decode replica that stepped;
        2. state, decision = decide(state, signals, config), starting from PolicyState.initial(config);
        3. broadcasts set_draft_lengths(decision.default_draft_len, per-request lengths) when a replica
           reports lengths that differ from the decision;
        4. exports the decision as metrics and logs decision.reason together with decision.signals.
"""

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Self

from controller.config import ControllerConfig
from controller.cost_model import DraftCost, StepCost, StepCostModel, fastest_draft_len, observe_steps
from controller.signals import LaneSignals, estimate_acceptance_rate, ewma, expected_tokens_per_step


class Load(StrEnum):
    SATURATED = "saturated"  # shed draft tokens: default L falls toward min_draft_len
    STEADY = "steady"  # inside the hysteresis band: default L holds unless acceptance collapses
    HEADROOM = "headroom"  # room for longer drafts if acceptance pays for them


@dataclass(frozen=True)
class LenKnob:
    """A draft length with hysteresis: it moves only after `dwell` consecutive decisions ask for the same
    direction, and then by at most `max_step`."""

    draft_len: int
    direction: int = 0  # sign of the move the last decision asked for: -1, 0 or +1
    streak: int = 0  # consecutive decisions that asked for `direction`


@dataclass(frozen=True)
class RequestState:
    knob: LenKnob
    accept_rate: float | None  # EWMA of the per-token acceptance rate; None before the first draft
    last_seen: int  # index of the last decision whose snapshot reported this request


@dataclass(frozen=True)
class PolicyState:
    decision_index: int
    default: LenKnob
    requests: dict[str, RequestState]  # never mutated: every decision builds a new dict
    arrival_rate_ewma_rps: float | None
    in_flight_ewma: float | None = None  # EWMA of requests_per_verify_batch
    in_flight_last: float = 0.0  # requests_per_verify_batch of the previous decision
    # Per-token acceptance over the requests that drafted, EWMA over decisions. Unlike the per-decision
    # fleet rate it outlives L = 0, where nothing drafts: the cost model needs it to tell when
    # speculation would pay again.
    fleet_accept_ewma: float | None = None
    step_cost: StepCostModel = StepCostModel()

    @classmethod
    def initial(cls, config: ControllerConfig) -> Self:
        return cls(0, LenKnob(config.initial_draft_len), {}, None)


@dataclass(frozen=True)
class Decision:
    """What to push to the decode replicas, and why (for the log line and the metrics)."""

    default_draft_len: int
    per_request_draft_len: dict[str, int]
    load: Load
    fleet_accept_rate: float | None  # per-token a, mean over requests that drafted; None if none did
    draft_len_cap: int  # the highest default L the load and the step cost allowed (load, p95 shed, cost cap)
    reason: str
    signals: LaneSignals
    step_cost: StepCost | None = None  # the step-cost fit behind the cost cap; None while there is none


def tokens_per_cost(accept_rate: float, draft_len: int, draft_cost_ratio: float) -> float:
    """Expected tokens per unit cost, one unit being one verify step: a cycle is `draft_len` drafter steps
    of relative cost c plus one verify step (Leviathan et al. 2023, walltime improvement factor)."""
    return expected_tokens_per_step(accept_rate, draft_len) / (1.0 + draft_cost_ratio * draft_len)


def optimal_draft_len(accept_rate: float, draft_cost_ratio: float, lo: int, hi: int) -> int:
    """argmax over L in [lo, hi] of `tokens_per_cost`; the shorter L on ties."""
    return max(range(lo, hi + 1), key=lambda n: tokens_per_cost(accept_rate, n, draft_cost_ratio))


def sticky_optimal_draft_len(accept_rate: float, current: int, lo: int, hi: int, config: ControllerConfig) -> int:
    """`optimal_draft_len`, except that an in-bounds `current` is kept unless the optimum beats it by
    `min_gain_frac`: neighbouring L are often within 1% of each other, and acceptance noise would
    otherwise flip between them."""
    best = optimal_draft_len(accept_rate, config.draft_cost_ratio, lo, hi)
    if not lo <= current <= hi:
        return best
    c = config.draft_cost_ratio
    gain = tokens_per_cost(accept_rate, best, c) / tokens_per_cost(accept_rate, current, c)
    return best if gain >= 1.0 + config.min_gain_frac else current


def classify_load(signals: LaneSignals, config: ControllerConfig) -> tuple[Load, str]:
    queue, p95_ms = signals.verify_queue_depth, signals.decode_step_p95_ms
    if queue >= config.verify_queue_high:
        return Load.SATURATED, f"verify_queue_depth={queue} >= verify_queue_high={config.verify_queue_high}"
    if p95_ms > config.target_decode_p95_ms:
        return Load.SATURATED, f"decode_step_p95_ms={p95_ms:.1f} > target={config.target_decode_p95_ms:.1f}"
    headroom_p95_ms = config.decode_headroom_frac * config.target_decode_p95_ms
    occupancy = signals.verify_batch_occupancy
    slo = signals.slo_pressure
    if slo > 1.0 and occupancy >= config.occupancy_high:
        # Over a latency target with full batches: shorter drafts give the target's compute back before
        # the planner adds replicas. With batches not full, shorter drafts would only lengthen TPOT.
        return Load.SATURATED, f"slo_pressure={slo:.2f} > 1 at verify_batch_occupancy={occupancy:.2f}"
    if (queue <= config.verify_queue_low and p95_ms <= headroom_p95_ms and occupancy < config.occupancy_high
            and slo <= config.slo_headroom_frac):
        return Load.HEADROOM, (
            f"verify_queue_depth={queue} <= {config.verify_queue_low}, decode_step_p95_ms={p95_ms:.1f} <= "
            f"{headroom_p95_ms:.1f}, verify_batch_occupancy={occupancy:.2f} < {config.occupancy_high:.2f}"
            + (f", slo_pressure={slo:.2f} <= {config.slo_headroom_frac:g}" if slo else "")
        )
    return Load.STEADY, f"verify_queue_depth={queue}, decode_step_p95_ms={p95_ms:.1f}, occupancy={occupancy:.2f}"


def load_cap_draft_len(requests_per_batch: float, config: ControllerConfig) -> int:
    """The longest L at which `requests_per_batch` requests fit a verify batch of `verify_token_budget`
    tokens, n (L + 1) <= budget, within [min_draft_len, max_draft_len]. No cap (max_draft_len) without a
    budget or without requests."""
    if config.verify_token_budget is None or requests_per_batch <= 0:
        return config.max_draft_len
    fit = math.floor(config.verify_token_budget / requests_per_batch) - 1
    return min(config.max_draft_len, max(config.min_draft_len, fit))


def batch_rows(signals: LaneSignals) -> float | None:
    """Requests per verify batch as the steps of this interval saw them: the mean rows per step of the
    busiest decode replica (the step-cost fit is per replica too). None when no replica stepped."""
    rows = [t.rows / t.num_steps for t in signals.step_totals if t.num_steps > 0]
    return max(rows) if rows else None


def measured_draft(signals: LaneSignals, config: ControllerConfig) -> DraftCost | None:
    """The drafter's measured forward as a line in the batch size, where the lanes measured it and the
    config takes measurements (controller/cost_model.py); None: c times the target's forward instead."""
    if not config.measure_draft_cost or not signals.draft_forward_ms:
        return None
    return DraftCost.through(signals.draft_forward_ms)


def cost_applies(cost: StepCost | None, rows: float | None, accept_rate: float | None, config: ControllerConfig) -> bool:
    """Whether the step-cost model can rank draft lengths now: it is on and has a fit, a batch (idle lanes
    are not compute-bound) and an acceptance rate."""
    return config.step_cost_enabled and cost is not None and rows is not None and accept_rate is not None


def cost_cap_draft_len(
    cost: StepCost | None, rows: float | None, accept_rate: float | None, current: int, config: ControllerConfig,
    draft: DraftCost | None = None,
) -> int:
    """The L with the most expected tokens per second at `rows` requests per verify batch under the step
    cost (controller/cost_model.py), 0 where no L > 0 beats speculation off by `spec_min_gain_frac`. No cap
    (max_draft_len) where the model does not apply (`cost_applies`)."""
    if not cost_applies(cost, rows, accept_rate, config):
        return config.max_draft_len
    return fastest_draft_len(cost, rows, accept_rate, current, config.min_draft_len, config.max_draft_len,
                             config.draft_cost_ratio, config.min_gain_frac, config.spec_min_gain_frac, draft)


def shed_draft_len(current: int, decode_p95_ms: float, config: ControllerConfig) -> int | None:
    """Where a decode p95 beyond `shed_margin_frac` over its target cuts the default L at once; None when
    the p95 is within the margin. A step's time grows with the tokens it verifies, L + 1 per request, so
    those are scaled by target / p95 (at least: on fixed per-step overhead the cut repeats next decision)."""
    target_ms = config.target_decode_p95_ms
    if decode_p95_ms <= (1.0 + config.shed_margin_frac) * target_ms:
        return None
    return max(config.min_draft_len, min(current, math.floor((current + 1) * target_ms / decode_p95_ms) - 1))


def is_arrival_surge(arrival_rate_rps: float, arrival_rate_ewma_rps: float | None, in_flight: float,
                     in_flight_last: float, surge_ratio: float) -> bool:
    # The queue only grows after a surge has arrived; holding L while arrivals outrun their average keeps
    # the controller from raising L into a ramp it has not seen in the queue yet. Arrivals that only
    # replace finished requests are no ramp, however bunched: clients in a closed loop start their next
    # requests together as their last ones end together, so one interval of a steady load reads a multiple
    # of the average rate. A surge must also outrun completions: the requests in flight grow.
    above_average = arrival_rate_ewma_rps is not None and arrival_rate_rps > surge_ratio * arrival_rate_ewma_rps
    return above_average and in_flight > in_flight_last


def wanted_draft_len(accept_rates: dict[str, float | None], config: ControllerConfig) -> int:
    """The longest L any tracked request would use if the lanes allowed it (L* grows with the acceptance
    rate, so that of the best request); the default L, which caps every per-request L, need not exceed
    it. Without measurements, `initial_draft_len`."""
    measured = [a for a in accept_rates.values() if a is not None]
    if not measured:
        return config.initial_draft_len
    # Acceptance alone never turns speculation off (only load does): at L = 0 no request could ever
    # show that it deserves a longer draft again.
    lo = max(config.min_draft_len, 1)
    return optimal_draft_len(max(measured), config.draft_cost_ratio, lo, config.max_draft_len)


@dataclass(frozen=True)
class CostView:
    """What the step-cost model says this decision: `cap`, the fastest L (max_draft_len where the model
    does not apply); `applies`, whether it ranked the lengths on a slope the steps themselves showed
    (`StepCostModel.informed`), so that it may overrule the load signals; `latency_room`, whether the
    decode p95 is within `decode_headroom_frac` of its target."""

    cap: int
    applies: bool
    latency_room: bool


def default_target(
    current: int,
    load: Load,
    wanted: int,
    fleet_accept: float | None,
    surge: bool,
    raise_cap: int,
    cost: CostView,
    queue_saturated: bool,
    config: ControllerConfig,
) -> tuple[int, str]:
    """Where the default L should head this decision, and why. `fleet_accept` is None when nothing was
    drafted (e.g. at L = 0): no evidence, so it neither blocks a raise nor forces a cut. `raise_cap` is
    the load cap with headroom: the highest L a raise may head for. `cost.cap` is the fastest L under the
    step cost: L above it falls to it, a raise stops at it.

    Where the step cost applies, it also rules what queue and occupancy only hint at: requests queue
    because the lanes deliver too few tokens per second, and the cost cap is the L that delivers the most,
    so a saturated queue sheds L down to the cap, not to `min_draft_len`, and a raise toward the cap needs
    only room in the decode p95, not an empty queue (an L that delivers more tokens per second at this
    batch also gives each request its tokens sooner). A decode p95 over its target, the queue under its
    high mark, still sheds to `min_draft_len`: that is latency, which shorter steps buy; and one far over
    it (`shed_margin_frac`) cuts L at once whatever the queue (`shed_draft_len`)."""
    if load is Load.SATURATED:
        if queue_saturated and cost.applies:
            return min(current, cost.cap), f"saturated: shed draft tokens down to the step cost's fastest L {cost.cap}"
        return config.min_draft_len, "saturated: shed draft tokens"
    if cost.cap < current:
        return cost.cap, f"lower: the step cost makes L {cost.cap} the fastest"
    if wanted > current:
        if load is not Load.HEADROOM and not (cost.applies and cost.latency_room and cost.cap > current):
            return current, f"hold: requests want {wanted} but no headroom"
        if surge:
            return current, f"hold: requests want {wanted} but arrivals are surging"
        if fleet_accept is not None and fleet_accept < config.accept_raise_min:
            return current, f"hold: requests want {wanted} but fleet acceptance < {config.accept_raise_min}"
        if raise_cap <= current:
            return current, f"hold: requests want {wanted} but the load cap with headroom is {raise_cap}"
        if cost.cap <= current:
            return current, f"hold: requests want {wanted} but the step cost makes L {cost.cap} the fastest"
        why = "headroom" if load is Load.HEADROOM else f"the step cost makes L {cost.cap} faster"
        return min(wanted, raise_cap, cost.cap), f"raise: {why} and requests want {wanted}"
    if wanted < current and fleet_accept is not None and fleet_accept < config.accept_lower_below:
        return wanted, f"lower: fleet acceptance < {config.accept_lower_below}, requests want {wanted}"
    return current, "hold"


def request_target(current: int, accept_rate: float | None, default_len: int, config: ControllerConfig) -> int:
    if accept_rate is None:
        return default_len
    # At least 1 while speculation is on: a request at L = 0 yields no acceptance samples and could
    # never earn a longer draft back.
    lo = min(max(config.min_draft_len, 1), default_len)
    return sticky_optimal_draft_len(accept_rate, current, lo, default_len, config)


def step_toward(knob: LenKnob, target: int, config: ControllerConfig, max_step: int | None = None) -> LenKnob:
    """One decision's move of `knob` toward `target`, by at most `max_step` (`config.max_step` unless
    given), once `raise_dwell` / `lower_dwell` decisions in a row asked for the same direction."""
    direction = (target > knob.draft_len) - (target < knob.draft_len)
    if direction == 0:
        return LenKnob(knob.draft_len)
    # The streak is not reset by a move: sustained pressure keeps moving L every decision.
    streak = knob.streak + 1 if direction == knob.direction else 1
    dwell = config.raise_dwell if direction > 0 else config.lower_dwell
    if streak < dwell:
        return LenKnob(knob.draft_len, direction, streak)
    step = min(config.max_step if max_step is None else max_step, abs(target - knob.draft_len))
    return LenKnob(knob.draft_len + direction * step, direction, streak)


def next_default(knob: LenKnob, target: int, load_cap: int, shed: int | None, config: ControllerConfig) -> LenKnob:
    """The default L after this decision. A shed cuts at once. Above the load cap, L heads for the cap
    with the usual dwell (one decision's burst of arrivals does not move it) but reaches it in one move,
    past `max_step`: a load that outgrew L costs latency for every request in flight."""
    if shed is not None and shed < knob.draft_len:
        return LenKnob(shed, -1, knob.streak + 1 if knob.direction < 0 else 1)
    return step_toward(knob, min(target, load_cap), config, max(config.max_step, knob.draft_len - load_cap))


def decide(state: PolicyState, signals: LaneSignals, config: ControllerConfig) -> tuple[PolicyState, Decision]:
    """One control decision: fold `signals` into the state, move the default and per-request L."""
    index = state.decision_index + 1
    accept_rates = _accept_rates(state.requests, signals, config.ewma_alpha)
    fleet_accept = _fleet_accept_rate(accept_rates, signals)
    wanted = wanted_draft_len(accept_rates, config)
    in_flight = signals.requests_per_verify_batch
    surge = is_arrival_surge(signals.arrival_rate_rps, state.arrival_rate_ewma_rps, in_flight, state.in_flight_last,
                             config.arrival_surge_ratio)
    load, load_why = classify_load(signals, config)
    current = state.default.draft_len
    load_cap = load_cap_draft_len(min(in_flight, state.in_flight_last), config)
    # Cuts follow the count itself (after lower_dwell), raises its EWMA, and only while the cap holds at
    # 1 / decode_headroom_frac times it: a band that the count's noise (Poisson arrivals) rarely crosses.
    in_flight_ewma = ewma(state.in_flight_ewma, in_flight, config.ewma_alpha)
    raise_cap = load_cap_draft_len(max(in_flight, in_flight_ewma) / config.decode_headroom_frac, config)
    shed = shed_draft_len(current, signals.decode_step_p95_ms, config)
    fleet_accept_ewma = (state.fleet_accept_ewma if fleet_accept is None
                         else ewma(state.fleet_accept_ewma, fleet_accept, config.ewma_alpha))
    step_cost = state.step_cost
    draft = measured_draft(signals, config)
    if config.step_cost_enabled:
        step_cost = observe_steps(step_cost, signals.step_totals, index, config.step_cost_window_decisions,
                                  config.draft_cost_ratio, config.step_cost_spread_frac, draft)
    rows = batch_rows(signals)
    cost_cap = cost_cap_draft_len(step_cost.fit, rows, fleet_accept_ewma, current, config, draft)
    latency_room = signals.decode_step_p95_ms <= config.decode_headroom_frac * config.target_decode_p95_ms
    ranks = step_cost.informed and cost_applies(step_cost.fit, rows, fleet_accept_ewma, config)
    cost = CostView(cost_cap, ranks, latency_room)
    queue_saturated = signals.verify_queue_depth >= config.verify_queue_high
    target, target_why = default_target(current, load, wanted, fleet_accept, surge, raise_cap, cost,
                                        queue_saturated, config)
    default = next_default(state.default, target, load_cap, shed, config)
    requests = _next_requests(state, signals, accept_rates, default.draft_len, index, config)
    arrival_ewma_rps = ewma(state.arrival_rate_ewma_rps, signals.arrival_rate_rps, config.ewma_alpha)
    new_state = PolicyState(index, default, requests, arrival_ewma_rps, in_flight_ewma, in_flight,
                            fleet_accept_ewma, step_cost)
    per_request = {rid: r.knob.draft_len for rid, r in requests.items()}
    cap = min(load_cap, cost_cap) if shed is None else min(load_cap, cost_cap, shed)
    reason = (
        f"{load}: {load_why}; default L {current} -> {default.draft_len} "
        f"(target {target}, {target_why}{_cap_why(load_cap, in_flight, shed, config)}"
        f"{_cost_why(cost_cap, step_cost.fit, rows, fleet_accept_ewma, config, draft)}, "
        f"streak {default.streak}); {_request_moves(state, requests)}; fleet acceptance {_fmt(fleet_accept)}"
    )
    decision = Decision(default.draft_len, per_request, load, fleet_accept, cap, reason, signals, step_cost.fit)
    return new_state, decision


def _accept_rates(
    requests: dict[str, RequestState], signals: LaneSignals, alpha: float
) -> dict[str, float | None]:
    """Acceptance EWMA of every tracked or reported request, with this snapshot folded in."""
    rates = {rid: r.accept_rate for rid, r in requests.items()}
    for rid, stats in signals.requests.items():
        sample = estimate_acceptance_rate(stats)
        rates[rid] = rates.get(rid) if sample is None else ewma(rates.get(rid), sample, alpha)
    return rates


def _fleet_accept_rate(accept_rates: dict[str, float | None], signals: LaneSignals) -> float | None:
    # Weighted by verify steps, not draft tokens: weighting by tokens would favour the long-L
    # (high-acceptance) requests and bias the fleet rate upward.
    weights = {rid: s.num_drafts for rid, s in signals.requests.items() if s.num_drafts > 0}
    if not weights:
        return None
    return sum(accept_rates[rid] * w for rid, w in weights.items()) / sum(weights.values())


def _next_requests(
    state: PolicyState,
    signals: LaneSignals,
    accept_rates: dict[str, float | None],
    default_len: int,
    index: int,
    config: ControllerConfig,
) -> dict[str, RequestState]:
    requests = {}
    for rid, accept in accept_rates.items():
        prev = state.requests.get(rid)
        last_seen = index if rid in signals.requests else prev.last_seen
        if index - last_seen > config.request_ttl_decisions:
            continue  # finished or moved away; bounded memory
        # A request new to the policy has been running at the previous default.
        knob = prev.knob if prev is not None else LenKnob(state.default.draft_len)
        if knob.draft_len > default_len:
            knob = LenKnob(default_len)  # the default caps every request's L, at once
        target = request_target(knob.draft_len, accept, default_len, config)
        knob = step_toward(knob, target, config)
        requests[rid] = RequestState(knob, accept, last_seen)
    return requests


def _request_moves(state: PolicyState, requests: dict[str, RequestState]) -> str:
    before = {rid: r.knob.draft_len for rid, r in state.requests.items()}
    prev_default = state.default.draft_len
    moves = [r.knob.draft_len - before.get(rid, prev_default) for rid, r in requests.items()]
    dropped = len(before.keys() - requests.keys())
    shorter, longer = sum(m < 0 for m in moves), sum(m > 0 for m in moves)
    return f"requests: {len(requests)} tracked, {shorter} shorter, {longer} longer, {dropped} dropped"


def _cap_why(load_cap: int, in_flight: float, shed: int | None, config: ControllerConfig) -> str:
    why = ""
    if config.verify_token_budget is not None:
        why += f", load cap {load_cap} at {in_flight:.1f} requests per verify batch"
    if shed is not None:
        why += f", shed to {shed}: decode p95 > {1 + config.shed_margin_frac:g} x target"
    return why


def _cost_why(
    cost_cap: int, cost: StepCost | None, rows: float | None, accept_rate: float | None, config: ControllerConfig,
    draft: DraftCost | None = None,
) -> str:
    if not cost_applies(cost, rows, accept_rate, config):
        return ""
    drafter = (f"drafter {draft.t0_ms:.2f} + {draft.slope_ms_per_row:.4f} ms/row measured" if draft is not None
               else f"drafter c = {config.draft_cost_ratio:.3f}")
    return (f", step cost {cost.t0_ms:.2f} + {cost.slope_ms_per_token:.4f} ms/token, {drafter}: L {cost_cap} "
            f"fastest at {rows:.1f} rows and acceptance {accept_rate:.3f}")


def _fmt(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.3f}"
