"""Draft-length policy: `decide(state, signals, config) -> (state, decision)`, a pure function the
controller actor calls once every `config.interval_s`.

What it decides
    - a default draft length L (used for every request a replica has no per-request L for, and the cap of
      all per-request L): driven to `min_draft_len` (0 = speculation off) while the lanes saturate, raised
      while there is headroom and the fleet's acceptance pays for it, up to the longest L that any
      request's acceptance rate justifies;
    - a per-request L: the L that maximises expected tokens per unit cost for that request's acceptance
      rate, capped by the default, so requests whose drafts keep failing get shorter drafts.
    Every L moves at most `max_step` per decision, and only after `raise_dwell` / `lower_dwell`
    consecutive decisions point the same way; queue and acceptance thresholds come in low/high pairs.

How the controller actor applies it (controller/actor.py)
    Decode replicas (DecodeLane) expose:
        stats() -> dict with running totals: per request in flight its draft_len and cumulative
            num_drafts, num_draft_tokens, num_accepted_tokens; waiting / prefilling / running counts,
            max_num_seqs, num_arrivals, step_p95_ms
        set_draft_lengths(default_len: int, per_request: dict[str, int]) -> None
            (a request missing from `per_request` runs at `default_len`)
    Each decision the actor:
        1. broadcasts stats() to every decode replica (and the verify lane in pdv), turns the running
           totals into per-interval deltas, and merges them into one `LaneSignals`: decode p95 = max
           over replicas (the slowest replica bounds the latency target), arrival rate from the arrival
           counts, requests = union (a request lives on one decode replica);
        2. state, decision = decide(state, signals, config), starting from PolicyState.initial(config);
        3. broadcasts set_draft_lengths(decision.default_draft_len, per-request lengths) when a replica
           reports lengths that differ from the decision;
        4. exports the decision as metrics and logs decision.reason together with decision.signals.
"""

from dataclasses import dataclass
from enum import StrEnum
from typing import Self

from controller.config import ControllerConfig
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
    reason: str
    signals: LaneSignals


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
    if queue <= config.verify_queue_low and p95_ms <= headroom_p95_ms and occupancy < config.occupancy_high:
        return Load.HEADROOM, (
            f"verify_queue_depth={queue} <= {config.verify_queue_low}, decode_step_p95_ms={p95_ms:.1f} <= "
            f"{headroom_p95_ms:.1f}, verify_batch_occupancy={occupancy:.2f} < {config.occupancy_high:.2f}"
        )
    return Load.STEADY, f"verify_queue_depth={queue}, decode_step_p95_ms={p95_ms:.1f}, occupancy={occupancy:.2f}"


def is_arrival_surge(arrival_rate_rps: float, arrival_rate_ewma_rps: float | None, surge_ratio: float) -> bool:
    # The queue only grows after a surge has arrived; holding L while arrivals outrun their average keeps
    # the controller from raising L into a ramp it has not seen in the queue yet.
    return arrival_rate_ewma_rps is not None and arrival_rate_rps > surge_ratio * arrival_rate_ewma_rps


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


def default_target(
    current: int, load: Load, wanted: int, fleet_accept: float | None, surge: bool, config: ControllerConfig
) -> tuple[int, str]:
    """Where the default L should head this decision, and why. `fleet_accept` is None when nothing was
    drafted (e.g. at L = 0): no evidence, so it neither blocks a raise nor forces a cut."""
    if load is Load.SATURATED:
        return config.min_draft_len, "saturated: shed draft tokens"
    if wanted > current:
        if load is not Load.HEADROOM:
            return current, f"hold: requests want {wanted} but no headroom"
        if surge:
            return current, f"hold: requests want {wanted} but arrivals are surging"
        if fleet_accept is not None and fleet_accept < config.accept_raise_min:
            return current, f"hold: requests want {wanted} but fleet acceptance < {config.accept_raise_min}"
        return wanted, f"raise: headroom and requests want {wanted}"
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


def step_toward(knob: LenKnob, target: int, config: ControllerConfig, force: bool = False) -> LenKnob:
    """One decision's move of `knob` toward `target`. `force` skips the dwell (used when the default L
    fell below a request's L: the cap must hold at once)."""
    direction = (target > knob.draft_len) - (target < knob.draft_len)
    if direction == 0:
        return LenKnob(knob.draft_len)
    # The streak is not reset by a move: sustained pressure keeps moving L every decision.
    streak = knob.streak + 1 if direction == knob.direction else 1
    dwell = config.raise_dwell if direction > 0 else config.lower_dwell
    if streak < dwell and not force:
        return LenKnob(knob.draft_len, direction, streak)
    step = min(config.max_step, abs(target - knob.draft_len))
    return LenKnob(knob.draft_len + direction * step, direction, streak)


def decide(state: PolicyState, signals: LaneSignals, config: ControllerConfig) -> tuple[PolicyState, Decision]:
    """One control decision: fold `signals` into the state, move the default and per-request L."""
    index = state.decision_index + 1
    accept_rates = _accept_rates(state.requests, signals, config.ewma_alpha)
    fleet_accept = _fleet_accept_rate(accept_rates, signals)
    wanted = wanted_draft_len(accept_rates, config)
    surge = is_arrival_surge(signals.arrival_rate_rps, state.arrival_rate_ewma_rps, config.arrival_surge_ratio)
    load, load_why = classify_load(signals, config)
    target, target_why = default_target(state.default.draft_len, load, wanted, fleet_accept, surge, config)
    default = step_toward(state.default, target, config)
    requests = _next_requests(state, signals, accept_rates, default.draft_len, index, config)
    arrival_ewma_rps = ewma(state.arrival_rate_ewma_rps, signals.arrival_rate_rps, config.ewma_alpha)
    new_state = PolicyState(index, default, requests, arrival_ewma_rps)
    per_request = {rid: r.knob.draft_len for rid, r in requests.items()}
    reason = (
        f"{load}: {load_why}; default L {state.default.draft_len} -> {default.draft_len} "
        f"(target {target}, {target_why}, streak {default.streak}); "
        f"{_request_moves(state, requests)}; fleet acceptance {_fmt(fleet_accept)}"
    )
    return new_state, Decision(default.draft_len, per_request, load, fleet_accept, reason, signals)


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
        target = request_target(knob.draft_len, accept, default_len, config)
        knob = step_toward(knob, target, config, force=knob.draft_len > default_len)
        requests[rid] = RequestState(knob, accept, last_seen)
    return requests


def _request_moves(state: PolicyState, requests: dict[str, RequestState]) -> str:
    before = {rid: r.knob.draft_len for rid, r in state.requests.items()}
    prev_default = state.default.draft_len
    moves = [r.knob.draft_len - before.get(rid, prev_default) for rid, r in requests.items()]
    dropped = len(before.keys() - requests.keys())
    shorter, longer = sum(m < 0 for m in moves), sum(m > 0 for m in moves)
    return f"requests: {len(requests)} tracked, {shorter} shorter, {longer} longer, {dropped} dropped"


def _fmt(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.3f}"
