"""Replica planner: how many replicas each lane needs to hold the TTFT and TPOT targets (`slo:` of the app
config, controller/config.py `SloConfig`). Pure functions, and `LanePlanner`, the Serve autoscaling policy
that applies them to one lane's deployment.

Who decides what
    - Serve's autoscaler owns the replica count of every lane: each lane's `autoscaling_config.policy` is a
      `LanePlanner`, which Serve's controller calls every control-loop tick with the lane's
      `AutoscalingContext`; the count it returns goes through Serve's own bounds (min_replicas >= 1, so a
      lane is never scaled below one replica), upscale_delay_s / downscale_delay_s and graceful shutdown.
    - The draft-length controller (controller/actor.py) owns L, as without targets.
    The planner reads L (each target lane's replicas report the L they run) but never sets it; the L
    controller never reads the replica count. They are kept apart by time scale and by one rule:
    - L moves first. A target lane over its target gets no replica while L is above the controller's
      `min_draft_len` and has had fewer than `draft_shed_grace_s` seconds to fall since the lane went over
      target or since L last fell (the L controller sheds in `lower_dwell` decisions, about 2 s); a
      latency `urgent_pressure` times its target skips the wait. Replicas then come after Serve's
      `upscale_delay_s` on top.
    - L takes freed capacity first: a lane gives up a replica only after Serve's `downscale_delay_s`
      (20 s) of asking, far longer than L's rise (`raise_dwell` decisions), and only while its load on one
      replica fewer would stay well under capacity (below), whatever L. (Holding a scale-down while L
      rose restarted Serve's delay at every move of L: on the CPU ramp, an L that moved every few seconds
      at 1x kept four replicas to the end.)
    - Hysteresis: a lane scales up when a latency passes its target (pressure > 1) and down only when
      its latencies are under `down_latency_frac` of their targets and its load, spread over one replica
      fewer, would be under `scale_down_frac` of its capacity. Each decision adds at most `max_step_up` replicas and removes at most one,
      and none while an earlier change is still starting or stopping replicas.

Each lane's signals (what its replicas return from `record_autoscaling_stats`, averaged by Serve over
`look_back_period_s`), and the latency it owns:
    engine  (unified, spec, nospec: one deployment) TTFT and TPOT against both targets; load: requests in
            flight over max_num_seqs.
    decode  (pd, pdv) TPOT against its target, and its requests in flight over max_num_seqs (past 1,
            requests wait for a slot).
    prefill (pd, pdv) its own time per prompt (queue + forward + hand-over) against `prefill_ttft_frac` of
            the TTFT target, and the time its waiting prompt tokens take to drain at its measured rate;
            load: the fraction of time it spends in forwards.
    verify  (pdv) its time per verify call against `verify_tokens_per_step` x the TPOT target, its queue
            (rows waiting per replica) against `verify_queue_high`, its batch occupancy against
            `occupancy_high`; load: the fraction of time it spends in forwards.

Standard library only: Serve cloudpickles this module by value into its controller process.
"""

import logging
import math
from dataclasses import dataclass, field

# Serve's controller logs "ray.serve" to its own log file.
log = logging.getLogger("ray.serve")

LANES = ("engine", "decode", "prefill", "verify")
# Metric names the replicas report (`record_autoscaling_stats`), and how a lane's replicas combine.
TTFT_MS, TPOT_MS = "ttft_p95_ms", "tpot_p95_ms"
IN_FLIGHT, MAX_NUM_SEQS, DRAFT_LEN = "in_flight", "max_num_seqs", "draft_len"
PREFILL_MS, PENDING_TOKENS, PREFILL_TOKENS_PER_S = "prefill_p95_ms", "pending_tokens", "prefill_tokens_per_s"
VERIFY_MS, PENDING_ROWS, OCCUPANCY, BUSY_FRAC = "verify_p95_ms", "pending_rows", "occupancy", "busy_frac"
_SUMMED = {IN_FLIGHT, MAX_NUM_SEQS, PENDING_TOKENS, PENDING_ROWS, PREFILL_TOKENS_PER_S}
_MEAN = {OCCUPANCY, BUSY_FRAC}  # everything else: the max over replicas (the slowest bounds the p95)


@dataclass(frozen=True)
class PlannerTargets:
    """One lane's targets and knobs: `SloConfig` with the lane's kind and the L controller's floor and verify
    thresholds, as plain numbers (Serve's policy_kwargs must be JSON)."""

    lane: str
    ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None
    prefill_ttft_frac: float = 0.7
    verify_tokens_per_step: float = 2.0
    verify_queue_high: float = 32.0
    occupancy_high: float = 0.9
    scale_down_frac: float = 0.6
    down_latency_frac: float = 0.8
    urgent_pressure: float = 2.0
    max_step_up: int = 2
    draft_shed_grace_s: float = 5.0
    # The L below which the L controller sheds nothing; None: the lane's L is not the planner's concern
    # (controller off, or a lane whose cost does not depend on L).
    min_draft_len: int | None = None

    def __post_init__(self) -> None:
        if self.lane not in LANES:
            raise ValueError(f"lane must be one of {LANES}, not {self.lane!r}")


@dataclass(frozen=True)
class Plan:
    replicas: int
    state: dict  # the planner's part of Serve's policy_state (JSON-able)
    pressure: float  # the largest owned latency (or queue) over its target; > 1 is over target
    load: float  # the fraction of the lane's capacity in use
    reason: str


@dataclass(frozen=True)
class Pressure:
    value: float = 0.0
    why: str = "no signal over target"
    terms: dict[str, float] = field(default_factory=dict)


def combine(metrics: dict[str, dict] | dict[str, list[float]]) -> dict[str, float]:
    """Per-replica values (as Serve's aggregated_metrics: name -> {replica: value}) -> one value per lane."""
    lane = {}
    for name, per_replica in metrics.items():
        values = list(per_replica.values()) if isinstance(per_replica, dict) else list(per_replica)
        if not values:
            continue
        if name in _SUMMED:
            lane[name] = float(sum(values))
        elif name in _MEAN:
            lane[name] = sum(values) / len(values)
        else:
            lane[name] = float(max(values))
    return lane


def lane_pressure(signals: dict[str, float], n: int, t: PlannerTargets) -> Pressure:
    """Each owned signal over its target; the largest is the lane's pressure."""
    terms = {}

    def ratio(name: str, value: float | None, target: float | None) -> None:
        if value is not None and target:
            terms[name] = value / target

    if t.lane in ("engine", "decode"):
        if t.lane == "engine":
            ratio(TTFT_MS, signals.get(TTFT_MS), t.ttft_p95_ms)
        ratio(TPOT_MS, signals.get(TPOT_MS), t.tpot_p95_ms)
        if t.lane == "decode" and signals.get(MAX_NUM_SEQS):
            # Past a full batch, requests wait for a decode slot after their prefill: TTFT the decode lane owns.
            terms[IN_FLIGHT] = signals.get(IN_FLIGHT, 0.0) / signals[MAX_NUM_SEQS]
    elif t.lane == "prefill" and t.ttft_p95_ms:
        budget_ms = t.prefill_ttft_frac * t.ttft_p95_ms
        ratio(PREFILL_MS, signals.get(PREFILL_MS), budget_ms)
        rate = signals.get(PREFILL_TOKENS_PER_S, 0.0)
        if rate > 0:  # the waiting prompt tokens, drained by the lane at its measured rate
            ratio(PENDING_TOKENS, 1e3 * signals.get(PENDING_TOKENS, 0.0) / rate, budget_ms)
    elif t.lane == "verify":
        if t.tpot_p95_ms:
            ratio(VERIFY_MS, signals.get(VERIFY_MS), t.tpot_p95_ms * t.verify_tokens_per_step)
        ratio(PENDING_ROWS, signals.get(PENDING_ROWS, 0.0) / max(n, 1), t.verify_queue_high)
        ratio(OCCUPANCY, signals.get(OCCUPANCY), t.occupancy_high)
    if not terms:
        return Pressure()
    name = max(terms, key=terms.get)
    return Pressure(terms[name], f"{name} at {terms[name]:.2f} of its target", terms)


def lane_load(signals: dict[str, float], t: PlannerTargets) -> float:
    """The fraction of the lane's capacity in use: batch slots taken (engine, decode), time in forwards
    (prefill, verify)."""
    if t.lane in ("engine", "decode"):
        seqs = signals.get(MAX_NUM_SEQS, 0.0)
        return signals.get(IN_FLIGHT, 0.0) / seqs if seqs else 0.0
    return signals.get(BUSY_FRAC, 0.0)


def wanted_replicas(n: int, pressure: float, load: float, t: PlannerTargets) -> tuple[int, str]:
    """Replicas the lane's signals ask for, before the draft-length rule: proportional to the pressure above
    target (latency and queues grow with the load per replica), one fewer well under it."""
    if pressure > 1.0:
        return min(n + t.max_step_up, max(n + 1, math.ceil(n * pressure))), "over target"
    if n > 1 and pressure <= t.down_latency_frac and load * n / (n - 1) <= t.scale_down_frac:
        return n - 1, f"load {load * n / (n - 1):.2f} on {n - 1} replicas"
    return n, "within target"


def track_draft_len(state: dict, draft_len: float | None, over: bool, now_s: float) -> dict:
    """The planner's memory of L: the last L seen, when it last fell, and since when the lane has been over
    target (None: it is not)."""
    new = dict(state)
    last = state.get("draft_len")
    if draft_len is not None:
        if last is not None and draft_len < last:
            new["draft_fell_s"] = now_s
        new["draft_len"] = draft_len
    if not over:
        new["over_since_s"] = None
    elif state.get("over_since_s") is None:
        new["over_since_s"] = now_s
    return new


def draft_first(want: int, n: int, pressure: float, state: dict, now_s: float, t: PlannerTargets
                ) -> tuple[int, str | None]:
    """Hold a scale-up while the L controller may still shed L."""
    draft_len = state.get("draft_len")
    if t.min_draft_len is None or draft_len is None:
        return want, None
    grace = t.draft_shed_grace_s
    if want > n and pressure < t.urgent_pressure and draft_len > t.min_draft_len:
        since = max(state.get("over_since_s") or now_s, state.get("draft_fell_s") or -math.inf)
        if now_s - since < grace:
            return n, f"L {draft_len:g} is shed first ({now_s - since:.1f} of {grace:g} s)"
    return want, None


def plan(n: int, signals: dict[str, float], state: dict, now_s: float, t: PlannerTargets) -> Plan:
    """One decision for a lane of `n` running replicas whose combined signals are `signals`."""
    pressure = lane_pressure(signals, n, t)
    load = lane_load(signals, t)
    state = track_draft_len(state, signals.get(DRAFT_LEN), pressure.value > 1.0, now_s)
    want, why = wanted_replicas(n, pressure.value, load, t)
    held, held_why = draft_first(want, n, pressure.value, state, now_s, t)
    reason = f"{t.lane}: {pressure.why}, load {load:.2f}; {n} -> {held} ({held_why or why})"
    return Plan(held, state, pressure.value, load, reason)


class LanePlanner:
    """Serve's autoscaling policy for one lane (`AutoscalingConfig.policy`, policy_kwargs: `PlannerTargets`'
    fields). Serve applies the count it returns within the lane's bounds and delays."""

    def __init__(self, **targets):
        self.targets = PlannerTargets(**targets)
        self._last_wanted: int | None = None

    def __call__(self, ctx) -> tuple[int, dict]:
        state = {k: v for k, v in (ctx.policy_state or {}).items() if k in _STATE_KEYS}
        running, target = ctx.current_num_replicas, ctx.target_num_replicas
        if running == 0 or running != target:
            # Replicas still starting or stopping: their signals are not in yet; decide once they are.
            return target, state
        signals = combine(ctx.aggregated_metrics or {})
        decision = plan(running, signals, state, ctx.current_time, self.targets)
        if decision.replicas != running and decision.replicas != self._last_wanted:
            log.info("planner %s: %s", ctx.deployment_name, decision.reason)  # once per change it asks for
        self._last_wanted = decision.replicas
        return decision.replicas, decision.state


_STATE_KEYS = ("draft_len", "draft_fell_s", "over_since_s")
