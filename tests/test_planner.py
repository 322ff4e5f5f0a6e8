"""Replica planner (controller/planner.py) on constructed signals, and closed loop with the real draft-length
policy (controller/policy.py `decide`) over a simulated lane: pure functions, no Ray, no models."""

import math
from dataclasses import dataclass, field

import pytest
from pydantic import ValidationError

from controller.config import ControllerConfig, SloConfig
from controller.planner import (
    DRAFT_LEN, IN_FLIGHT, MAX_NUM_SEQS, OCCUPANCY, PENDING_ROWS, PENDING_TOKENS, PREFILL_MS, PREFILL_TOKENS_PER_S,
    TPOT_MS, TTFT_MS, VERIFY_MS, LanePlanner, PlannerTargets, combine, lane_pressure, plan, wanted_replicas)
from controller.policy import PolicyState, decide
from controller.signals import LaneSignals, RequestDraftStats, expected_tokens_per_step

ENGINE = PlannerTargets("engine", ttft_p95_ms=1000, tpot_p95_ms=30, min_draft_len=1)


def test_slo_needs_a_target_and_a_look_back_past_the_interval():
    assert SloConfig(tpot_p95_ms=40).ttft_p95_ms is None
    with pytest.raises(ValidationError, match="needs a target"):
        SloConfig()
    with pytest.raises(ValidationError, match="look_back_period_s"):
        SloConfig(ttft_p95_ms=500, metrics_interval_s=2, look_back_period_s=2)
    with pytest.raises(ValidationError):
        SloConfig(ttft_p95_ms=-1)


def test_replicas_combine_by_what_each_signal_means():
    lane = combine({TTFT_MS: {"a": 100, "b": 300}, IN_FLIGHT: {"a": 2, "b": 5}, OCCUPANCY: {"a": 0.2, "b": 0.6}})
    assert lane == {TTFT_MS: 300, IN_FLIGHT: 7, OCCUPANCY: pytest.approx(0.4)}


def test_each_lane_owns_its_latency():
    engine = lane_pressure({TTFT_MS: 1500, TPOT_MS: 15}, 1, ENGINE)
    assert engine.value == 1.5 and TTFT_MS in engine.why
    decode = PlannerTargets("decode", ttft_p95_ms=1000, tpot_p95_ms=30)
    # The decode lane of pd/pdv answers for TPOT and its slots, not for TTFT (the prefill lane's).
    assert lane_pressure({TTFT_MS: 5000, TPOT_MS: 15, IN_FLIGHT: 4, MAX_NUM_SEQS: 8}, 1, decode).value == 0.5
    assert lane_pressure({TPOT_MS: 15, IN_FLIGHT: 12, MAX_NUM_SEQS: 8}, 1, decode).value == 1.5
    prefill = PlannerTargets("prefill", ttft_p95_ms=1000, prefill_ttft_frac=0.5)
    assert lane_pressure({PREFILL_MS: 250}, 1, prefill).value == 0.5
    # 2000 waiting prompt tokens at 1000 tokens/s drain in 2 s: 4x the lane's 500 ms share.
    assert lane_pressure({PREFILL_MS: 250, PENDING_TOKENS: 2000, PREFILL_TOKENS_PER_S: 1000}, 1, prefill).value == 4
    verify = PlannerTargets("verify", tpot_p95_ms=20, verify_tokens_per_step=2, verify_queue_high=8)
    assert lane_pressure({VERIFY_MS: 60, PENDING_ROWS: 4, OCCUPANCY: 0.3}, 1, verify).value == 1.5
    assert lane_pressure({VERIFY_MS: 10, PENDING_ROWS: 32, OCCUPANCY: 0.3}, 2, verify).value == 2  # 16 per replica


def test_up_in_proportion_down_one_at_a_time_with_hysteresis():
    t = PlannerTargets("engine", ttft_p95_ms=1000, max_step_up=2, scale_down_frac=0.6, down_latency_frac=0.8)
    assert wanted_replicas(2, 1.4, 0.9, t)[0] == 3
    assert wanted_replicas(1, 5.0, 1.0, t)[0] == 3  # at most max_step_up at once
    assert wanted_replicas(3, 0.9, 0.3, t)[0] == 3  # under target, not far enough for one fewer
    assert wanted_replicas(3, 0.5, 0.45, t)[0] == 3  # 0.45 x 3/2 > 0.6
    assert wanted_replicas(3, 0.7, 0.3, t)[0] == 2
    assert wanted_replicas(1, 0.0, 0.0, t)[0] == 1  # never below one replica


def test_l_is_shed_before_replicas_are_added():
    over = {TTFT_MS: 1500, TPOT_MS: 20, DRAFT_LEN: 6}
    p = plan(1, over, {}, 100.0, ENGINE)
    assert p.replicas == 1 and "shed first" in p.reason
    # L falls: the wait starts again from the fall.
    p = plan(1, {**over, DRAFT_LEN: 4}, p.state, 104.0, ENGINE)
    assert p.replicas == 1
    assert plan(1, {**over, DRAFT_LEN: 4}, p.state, 108.0, ENGINE).replicas == 1
    # L stopped falling for the grace: now replicas.
    assert plan(1, {**over, DRAFT_LEN: 4}, p.state, 109.5, ENGINE).replicas == 2
    # At the floor, or far over target, nothing to wait for.
    assert plan(1, {**over, DRAFT_LEN: 1}, {}, 100.0, ENGINE).replicas == 2
    assert plan(1, {**over, TTFT_MS: 2500}, {}, 100.0, ENGINE).replicas == 3
    # A lane whose cost does not depend on L (or with the L controller off) never waits.
    assert plan(1, over, {}, 100.0, PlannerTargets("engine", ttft_p95_ms=1000)).replicas == 2


def test_moves_of_l_do_not_hold_a_scale_down():
    # A hold would restart Serve's downscale delay: an L that moves every few seconds would keep every replica.
    quiet = {TTFT_MS: 200, TPOT_MS: 10, IN_FLIGHT: 1, MAX_NUM_SEQS: 8}
    state = {}
    for now_s, draft_len in enumerate((2, 5, 3, 6, 4, 7)):
        p = plan(3, {**quiet, DRAFT_LEN: draft_len}, state, float(now_s), ENGINE)
        assert p.replicas == 2
        state = p.state


@dataclass
class _Ctx:
    """The fields of Serve's AutoscalingContext that the policy reads."""

    current_num_replicas: int
    target_num_replicas: int
    aggregated_metrics: dict
    policy_state: dict = field(default_factory=dict)
    current_time: float = 100.0
    deployment_name: str = "DecodeLane"


def test_serve_policy_waits_for_a_change_in_flight_and_keeps_only_its_state():
    policy = LanePlanner(lane="engine", ttft_p95_ms=1000, tpot_p95_ms=30)
    metrics = {TTFT_MS: {"r1": 3000}, IN_FLIGHT: {"r1": 8}, MAX_NUM_SEQS: {"r1": 8}}
    assert policy(_Ctx(1, 2, metrics))[0] == 2  # the second replica is starting: hold
    replicas, state = policy(_Ctx(1, 1, metrics, {"serve_internal": 3}))
    assert replicas == 3 and "serve_internal" not in state


# --- closed loop: planner + draft-length policy + a simulated lane ------------------------------------

ACCEPT = 0.8  # per-token acceptance of the simulated pair
OUTPUT_TOKENS = 64
MAX_NUM_SEQS_SIM = 8


def _step_ms(rows: float, draft_len: int) -> float:
    # A step verifies rows x (L + 1) tokens and drafts L tokens per row: speculation shortens TPOT at a small
    # batch and costs capacity at a full one, as on a compute-bound target.
    return 8.0 + rows * (1.5 * (draft_len + 1) + 0.5 * draft_len)


def _capacity_rps(draft_len: int) -> float:
    tokens_per_s = MAX_NUM_SEQS_SIM * expected_tokens_per_step(ACCEPT, draft_len) / _step_ms(MAX_NUM_SEQS_SIM, draft_len)
    return 1e3 * tokens_per_s / OUTPUT_TOKENS


@dataclass
class _Serve:
    """Serve's delay logic: a count the policy asks for is applied once asked for `delay_s` in a row."""

    up_delay_s: float
    down_delay_s: float
    target: int = 1
    since_s: float | None = None
    direction: int = 0

    def apply(self, want: int, now_s: float) -> int:
        direction = (want > self.target) - (want < self.target)
        if direction != self.direction:
            self.direction, self.since_s = direction, now_s
        delay = self.up_delay_s if direction > 0 else self.down_delay_s
        if direction and now_s - self.since_s >= delay:
            self.target, self.direction = want, 0
        return self.target


BASE_RPS = 0.5 * _capacity_rps(4)  # "1x": half of one replica's capacity at L = 4


def _ramp_rps(t_s: float, period_s: float = 60.0) -> float:
    """1x for a period, up to 4x over two, 4x for two, down to 1x over two, then 1x."""
    x = t_s / period_s
    if x < 1 or x >= 7:
        factor = 1.0
    elif x < 3:
        factor = 1 + 3 * (x - 1) / 2
    elif x < 5:
        factor = 4.0
    else:
        factor = 4 - 3 * (x - 5) / 2
    return BASE_RPS * factor


def _simulate(slo: SloConfig, rate_rps=_ramp_rps, seconds: int = 560) -> list[dict]:
    """One decision of each controller per simulated second; the lane's state every second."""
    controller = ControllerConfig(interval_s=1.0, min_draft_len=1, max_draft_len=8, initial_draft_len=4,
                                  target_decode_p95_ms=100.0, verify_queue_high=32, verify_queue_low=8,
                                  step_cost_enabled=False, draft_cost_ratio=0.15)
    targets = PlannerTargets("engine", ttft_p95_ms=slo.ttft_p95_ms, tpot_p95_ms=slo.tpot_p95_ms,
                             scale_down_frac=slo.scale_down_frac, down_latency_frac=slo.down_latency_frac,
                             urgent_pressure=slo.urgent_pressure,
                             max_step_up=slo.max_step_up, draft_shed_grace_s=slo.draft_shed_grace_s,
                             min_draft_len=controller.min_draft_len)
    serve = _Serve(slo.upscale_delay_s, slo.downscale_delay_s)
    policy, planner_state = PolicyState.initial(controller), {}
    draft_len, backlog, trace = controller.initial_draft_len, 0.0, []
    for now in range(seconds):
        n = serve.target
        rate = rate_rps(now)
        capacity = n * _capacity_rps(draft_len)
        backlog = max(0.0, backlog + rate - capacity)  # requests waiting for a batch slot, over all replicas
        rho = min(rate / capacity, 1.0)
        rows = max(1.0, rho * MAX_NUM_SEQS_SIM)
        step = _step_ms(rows, draft_len)
        tpot = step / expected_tokens_per_step(ACCEPT, draft_len)
        ttft = 150 + 1e3 * backlog / capacity + 150 * min(rho / (1 - rho), 10) if rho < 1 else 2000 + 1e3 * backlog / capacity
        in_flight = n * rows + backlog
        # The L controller: one decision a second on what the lane shows.
        drafts = 20
        accepted = round(drafts * (expected_tokens_per_step(ACCEPT, draft_len) - 1))
        signals = LaneSignals(verify_queue_depth=round(backlog), verify_batch_occupancy=rho, decode_step_p95_ms=step,
                              arrival_rate_rps=rate, slo_pressure=max(ttft / slo.ttft_p95_ms, tpot / slo.tpot_p95_ms),
                              requests={"r": RequestDraftStats(drafts, drafts * draft_len,
                                                                                      accepted)})
        policy, decision = decide(policy, signals, controller)
        # The planner: one decision a second too (Serve calls it every 0.1 s on signals averaged over seconds).
        p = plan(n, {TTFT_MS: ttft, TPOT_MS: tpot, IN_FLIGHT: in_flight, MAX_NUM_SEQS: n * MAX_NUM_SEQS_SIM,
                     DRAFT_LEN: draft_len}, planner_state, float(now), targets)
        planner_state = p.state
        trace.append({"t": now, "rate": rate, "replicas": n, "draft_len": draft_len, "ttft": ttft, "tpot": tpot})
        serve.apply(p.replicas, float(now))
        draft_len = decision.default_draft_len
    return trace


def _reversals(values: list[int]) -> int:
    moves = [b - a for a, b in zip(values, values[1:]) if b != a]
    return sum((a > 0) != (b > 0) for a, b in zip(moves, moves[1:]))


def test_replicas_and_l_follow_a_ramp_without_fighting():
    slo = SloConfig(ttft_p95_ms=1000, tpot_p95_ms=30)
    trace = _simulate(slo)
    replicas = [s["replicas"] for s in trace]
    lengths = [s["draft_len"] for s in trace]
    first_up = next(i for i, n in enumerate(replicas) if n > 1)
    # L is shed before the first replica is added ...
    assert min(lengths[:first_up]) < 4
    # ... replicas go up, then down, once each way: no flip-flop ...
    assert max(replicas) >= 3 and _reversals(replicas) == 1, replicas
    # ... L moves down and back up a bounded number of times, and is back above its start at the end,
    # on the one replica the lane started with.
    assert _reversals(lengths) <= 4, lengths
    assert replicas[-1] == 1 and lengths[-1] >= 4
    # After 20 s of settling from each change of the ramp, both targets hold in at least 90% of the seconds.
    settled = [s for s in trace if s["t"] % 120 >= 20 or s["t"] < 60]
    within = [s["ttft"] <= slo.ttft_p95_ms and s["tpot"] <= slo.tpot_p95_ms for s in settled]
    assert sum(within) >= 0.9 * len(within)


def test_a_steady_load_near_the_scaling_boundaries_changes_replicas_at_most_twice():
    slo = SloConfig(ttft_p95_ms=1000, tpot_p95_ms=30)
    for factor in (1.0, 1.3, 1.6, 2.0, 2.5, 3.0):
        trace = _simulate(slo, lambda t_s: factor * BASE_RPS, seconds=400)
        replicas = [s["replicas"] for s in trace]
        assert sum(a != b for a, b in zip(replicas, replicas[1:])) <= 2, (factor, replicas)


def test_slo_turns_every_lane_into_a_planner_autoscaled_deployment():
    from deployments.builder import _options
    from deployments.config import AppConfig

    cfg = AppConfig.model_validate({
        "mode": "pdv", "engine": {"max_model_len": 256}, "controller": {"min_draft_len": 1},
        "slo": {"ttft_p95_ms": 500, "tpot_p95_ms": 40, "max_replicas": 3},
        "decode_lane": {"num_replicas": 2},
        # A lane's own autoscaling_config overrides the planner's bounds and delays.
        "verify_lane": {"autoscaling_config": {"max_replicas": 5, "downscale_delay_s": 60}}})
    lanes = {lane: _options(cfg, lane) for lane in cfg.lanes}
    for lane, opts in lanes.items():
        assert "num_replicas" not in opts
        auto = opts["autoscaling_config"]
        assert auto["min_replicas"] == 1 and auto["policy"]["policy_function"] == "controller.planner:LanePlanner"
        PlannerTargets(**auto["policy"]["policy_kwargs"])  # what Serve's controller builds it from
    kwargs = {lane: o["autoscaling_config"]["policy"]["policy_kwargs"] for lane, o in lanes.items()}
    assert [kwargs[lane]["lane"] for lane in cfg.lanes] == ["prefill", "decode", "verify"]
    assert kwargs["prefill_lane"]["min_draft_len"] is None and kwargs["verify_lane"]["min_draft_len"] == 1
    assert lanes["decode_lane"]["autoscaling_config"]["initial_replicas"] == 2
    assert lanes["verify_lane"]["autoscaling_config"]["max_replicas"] == 5
    assert lanes["verify_lane"]["autoscaling_config"]["downscale_delay_s"] == 60
    # Decode replicas drain their streams for as long as a request may run.
    assert lanes["decode_lane"]["graceful_shutdown_timeout_s"] == cfg.request_timeout_s
    assert not cfg.uses_verify_channel  # an autoscaled verify lane: through Serve, as with autoscaling_config


def test_a_lane_cannot_start_above_its_planner_bound():
    from deployments.config import AppConfig

    with pytest.raises(ValidationError, match="exceeds its max_replicas"):
        AppConfig.model_validate({"mode": "unified", "engine": {"max_model_len": 256},
                                  "slo": {"ttft_p95_ms": 500, "max_replicas": 2}, "decode_lane": {"num_replicas": 3}})


def test_a_gpu_lane_is_bounded_by_the_replicas_its_share_fits_on_the_cluster():
    from deployments.config import AppConfig
    from deployments.planning import gpu_replica_bound, planner_options

    def bound(mode: str, cluster_gpus: float | None, **lanes) -> dict:
        cfg = AppConfig.model_validate({"mode": mode, "engine": {"max_model_len": 256},
                                        "slo": {"ttft_p95_ms": 500, "max_replicas": 8}, **lanes})
        return {lane: planner_options(cfg, lane, {}, cluster_gpus)["autoscaling_config"]["max_replicas"]
                for lane in cfg.lanes}

    # A quarter of one GPU: four replicas fit; thirds: three (not 2.9999...); on two GPUs, twice as many.
    assert bound("unified", 1, decode_lane={"num_gpus": 0.25}) == {"decode_lane": 4}
    assert bound("unified", 1, decode_lane={"num_gpus": 1 / 3}) == {"decode_lane": 3}
    assert bound("unified", 2, decode_lane={"num_gpus": 0.3}) == {"decode_lane": 6}
    # slo.max_replicas stays the bound where the GPUs hold more, on a CPU lane, and where GPU nodes start on demand.
    assert bound("unified", 4, decode_lane={"num_gpus": 0.25}) == {"decode_lane": 8}
    assert bound("unified", 1) == {"decode_lane": 8}
    assert bound("unified", None, decode_lane={"num_gpus": 0.25}) == {"decode_lane": 8}
    # Lanes sharing the GPU leave each other their one replica; a lane starts within its bound.
    assert bound("pd", 1, prefill_lane={"num_gpus": 0.2}, decode_lane={"num_gpus": 0.2, "num_replicas": 2}) == {
        "prefill_lane": 4, "decode_lane": 4}
    cfg = AppConfig.model_validate({"mode": "unified", "engine": {"max_model_len": 256}, "decode_lane": {
        "num_gpus": 0.5, "num_replicas": 3}, "slo": {"ttft_p95_ms": 500}})
    assert gpu_replica_bound(cfg, "decode_lane", 1) == 2
    assert planner_options(cfg, "decode_lane", {}, 1)["autoscaling_config"]["initial_replicas"] == 2


def test_a_ramp_of_arrivals_follows_its_schedule():
    import numpy as np

    from loadtest.arrivals import RampLoop

    ramp = RampLoop(((0.0, 2.0), (100.0, 2.0), (200.0, 8.0)))
    assert ramp.rate_at(150.0) == 5.0 and ramp.rate_at(500.0) == 8.0 and ramp.load == 8.0
    gaps, t_s, times = ramp.gaps_s(np.random.default_rng(0)), 0.0, []
    while t_s < 300:
        t_s += next(gaps)
        times.append(t_s)
    counts = [sum(lo <= t < lo + 100 for t in times) for lo in (0, 100, 200)]
    # Expected 200, 500 and 800 (Poisson: within 4 standard deviations).
    assert all(abs(c - e) < 4 * e ** 0.5 for c, e in zip(counts, (200, 500, 800))), counts
    with pytest.raises(ValueError):
        RampLoop(((1.0, 2.0),))
