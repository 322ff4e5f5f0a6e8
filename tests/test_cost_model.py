"""The step-cost model (controller/cost_model.py): the fit of step time against tokens verified, and the
draft length it makes fastest; and the controller's reading of the replicas' step totals. Pure
functions on constructed samples: no Ray instance, no models.
"""

import random
import time
from types import SimpleNamespace

import pytest
import torch

from controller.actor import MAX_DRAFT_COST_RATIO, SignalReader, drafter_forward_ms, measured_draft_cost_ratio
from controller.cost_model import (DraftCost, StepCost, StepCostModel, fastest_draft_len, fit_step_cost, observe_steps,
                                   tokens_per_s)
from controller.policy import optimal_draft_len
from controller.signals import StepTotals
from deployments.telemetry.engine_metrics import STEP_WINDOW_STEPS, EngineMetrics
from lanes.engine.snapshot import core_report, snapshot
from lanes.model import forward_cost
from lanes.model.forward_cost import CALIBRATION_REPEATS, CALIBRATION_ROWS, forward_costs_ms
from lanes.sample.params import SamplingParams
from tests.conftest import VOCAB
from tests.engine_helpers import random_prompts, small_engine

C = 0.1  # draft cost ratio
SPREAD = 0.02
# A compute-bound target: 3 ms + 0.1 ms per verified token (9.4 ms at 64 tokens, 35 ms at 320).
COMPUTE_BOUND = StepCost(3.0, 0.1)


def _totals(cost: StepCost, rows: int, draft_len: int, num_steps: int = 50, noise: float = 0.0,
            rng: random.Random | None = None) -> StepTotals:
    """What a replica reports for `num_steps` steps of `rows` requests drafting `draft_len` tokens each,
    when a step truly costs `cost.step_ms` (times 1 + Gaussian noise of sd `noise`)."""
    step_ms = cost.step_ms(rows, draft_len, C)
    total_ms = sum(step_ms * (1.0 + (rng.gauss(0.0, noise) if rng else 0.0)) for _ in range(num_steps))
    return StepTotals(num_steps, total_ms, rows * num_steps, rows * draft_len * num_steps, draft_len * num_steps)


def test_step_ms_is_a_verify_forward_plus_draft_forwards():
    # 64 rows at L = 4: the target verifies 320 tokens (35 ms), the drafter runs 4 forwards over 64 rows
    # at 0.1 of the target's 9.4 ms each.
    assert COMPUTE_BOUND.step_ms(64, 4, C) == pytest.approx(35.0 + 4 * 0.94)
    assert COMPUTE_BOUND.step_ms(64, 0, C) == pytest.approx(9.4)


# --- the fit --------------------------------------------------------------------------------------------


def test_fit_recovers_the_line_from_steps_that_draft():
    """Samples over batch sizes and draft lengths, drafting included in every step time: the fit finds the
    target's line, not one bent by the drafter's forwards. The slope prior (0, no previous fit) costs
    0.3 % of t0 and 0.1 % of the slope at this spread; with the true slope as the previous fit the line is
    exact."""
    samples = [_totals(COMPUTE_BOUND, n, draft_len) for n, draft_len in [(8, 0), (16, 2), (32, 4), (64, 0), (64, 4)]]
    fit = fit_step_cost(samples, None, C, SPREAD)
    assert fit.t0_ms == pytest.approx(3.0, rel=5e-3)
    assert fit.slope_ms_per_token == pytest.approx(0.1, rel=1e-3)
    exact = fit_step_cost(samples, COMPUTE_BOUND, C, SPREAD)
    assert (exact.t0_ms, exact.slope_ms_per_token) == (pytest.approx(3.0), pytest.approx(0.1))
    # Fitted without the drafter's share (c = 0), the drafter's forwards read as a 12 % steeper target.
    blind = fit_step_cost(samples, None, 0.0, SPREAD)
    assert blind.slope_ms_per_token > 0.11


def test_fit_of_noisy_steps_at_one_draft_length_finds_the_slope_from_the_batch_size():
    """At L = 0 under a load whose batch wanders 56-72 rows (steps with 5 % noise), the slope still shows."""
    rng = random.Random(0)
    samples = [_totals(COMPUTE_BOUND, (56, 64, 72)[i % 3], 0, noise=0.05, rng=rng) for i in range(30)]
    fit = fit_step_cost(samples, None, C, SPREAD)
    assert fit.slope_ms_per_token == pytest.approx(0.1, rel=0.1)
    assert fit.forward_ms(64) == pytest.approx(9.4, rel=0.01)


def test_window_without_spread_keeps_the_previous_slope():
    """Every step verifies the same 64 tokens in 10 ms: the window cannot tell a slope. Without a previous
    fit the cost is taken as flat; with one, its slope stays and the line passes through what was seen."""
    flat_64 = [_totals(StepCost(10.0, 0.0), 64, 0)] * 5
    assert fit_step_cost(flat_64, None, C, SPREAD) == StepCost(pytest.approx(10.0), 0.0)
    kept = fit_step_cost(flat_64, COMPUTE_BOUND, C, SPREAD)
    assert kept.slope_ms_per_token == pytest.approx(0.1)
    assert kept.forward_ms(64) == pytest.approx(10.0)


def test_fit_keeps_t0_and_slope_non_negative():
    # Step times that fall as tokens rise (noise, a warming cache): no negative slope, the mean instead.
    falling = [StepTotals(10, 10 * ms, 10 * n, 0, 0.0) for n, ms in [(16, 12.0), (32, 11.0), (64, 10.0)]]
    fit = fit_step_cost(falling, None, C, SPREAD)
    assert fit.slope_ms_per_token == 0.0 and fit.t0_ms > 10.0
    # Steeper than proportional (0.2 ms per token minus 2 ms): t0 = 0 and the best line through the origin.
    steep = [StepTotals(10, 10 * (0.2 * n - 2.0), 10 * n, 0, 0.0) for n in (16, 32, 64)]
    fit = fit_step_cost(steep, None, C, SPREAD)
    assert fit.t0_ms == 0.0
    sizes = (16, 32, 64)
    assert fit.slope_ms_per_token == pytest.approx(sum(n * (0.2 * n - 2) for n in sizes) / sum(n * n for n in sizes))


def test_observe_steps_forgets_samples_older_than_the_window():
    """Compute-bound samples at decisions 1-5, then flat ones (10 ms at every size): once the compute-bound
    samples have left a 10-decision window the fit is flat, up to the slope the prior carries over."""
    model = StepCostModel()
    for i in range(1, 6):
        model = observe_steps(model, [_totals(COMPUTE_BOUND, (16, 32, 64)[i % 3], 2)], i, 10, C, SPREAD)
    assert model.fit.slope_ms_per_token == pytest.approx(0.1, rel=1e-2)
    flat = StepCost(10.0, 0.0)
    for i in range(6, 16):
        model = observe_steps(model, [_totals(flat, (16, 32, 64)[i % 3], 0)], i, 10, C, SPREAD)
    assert [index for index, _ in model.samples] == list(range(6, 16))
    assert model.fit.slope_ms_per_token < 1e-3
    # An idle interval (no replica stepped) leaves the model as it was.
    assert observe_steps(model, [], 16, 10, C, SPREAD) is model


def test_the_model_is_informed_once_a_window_spread_enough_to_tell_the_slope():
    """A steady batch (64 rows at L = 0 every decision) leaves the slope at the prior's 0: the model is
    not informed, and the policy lets it cap L but not overrule the load signals. Batches of 56-72 rows
    (a standard deviation of 10 % of the mean, over `spread_frac`) inform it, and it stays informed when a
    steady batch follows (the slope carries over)."""
    model = StepCostModel()
    for i in range(5):
        model = observe_steps(model, [_totals(COMPUTE_BOUND, 64, 0)], i, 10, C, SPREAD)
    assert not model.informed and model.fit.slope_ms_per_token == 0.0
    for i in range(5, 8):
        model = observe_steps(model, [_totals(COMPUTE_BOUND, (56, 64, 72)[i % 3], 0)], i, 10, C, SPREAD)
    assert model.informed and model.fit.slope_ms_per_token > 0.05
    for i in range(8, 30):
        model = observe_steps(model, [_totals(COMPUTE_BOUND, 64, 0)], i, 10, C, SPREAD)
    assert model.informed


# --- the fastest draft length ---------------------------------------------------------------------------


def test_tokens_per_s_matches_hand_arithmetic_and_the_margin_decides():
    """64 rows, a = 0.8 on the compute-bound line. L = 0: 64 tokens per 9.4 ms = 6808.5 tokens/s.
    L = 1: 64 x 1.8 tokens per t(128) + 0.1 t(64) = 15.8 + 0.94 ms: 6881.7 tokens/s, 1.1 % more, which the
    3 % margin does not take (the model's own error is larger); without a margin L = 1 wins."""
    assert tokens_per_s(COMPUTE_BOUND, 64, 0.8, 0, C) == pytest.approx(64 / 9.4e-3)
    assert tokens_per_s(COMPUTE_BOUND, 64, 0.8, 1, C) == pytest.approx(64 * 1.8 / 16.74e-3)
    assert fastest_draft_len(COMPUTE_BOUND, 64, 0.8, 0, 0, 8, C, 0.02, 0.03) == 0
    assert fastest_draft_len(COMPUTE_BOUND, 64, 0.8, 0, 0, 8, C, 0.02, 0.0) == 1
    # min_draft_len 1: speculation cannot be turned off, the fastest L >= 1 it is.
    assert fastest_draft_len(COMPUTE_BOUND, 64, 0.8, 0, 1, 8, C, 0.02, 0.03) == 1


@pytest.mark.parametrize("accept_rate", [0.2, 0.5, 0.7, 0.8, 0.9, 0.95])
def test_flat_step_cost_gives_the_tokens_per_cost_optimum(accept_rate: float):
    """b = 0 (memory-bound): tokens per second is the policy's tokens per unit cost, so both pick one L."""
    flat = StepCost(10.0, 0.0)
    best = optimal_draft_len(accept_rate, C, 0, 8)
    for rows in (1, 16, 64):
        assert fastest_draft_len(flat, rows, accept_rate, 0, 0, 8, C, 0.0, 0.0) == best


def test_speculation_pays_at_small_batches_and_not_at_large_ones_on_one_line():
    """TensorRT-LLM's auto-off by batch size, from the cost model: on the compute-bound line at a = 0.7,
    4 rows verify 20 tokens at L = 4, where t0 still dominates; 64 rows spend 0.1 ms on every token."""
    by_rows = {rows: fastest_draft_len(COMPUTE_BOUND, rows, 0.7, 0, 0, 8, C, 0.02, 0.03) for rows in (1, 4, 16, 32, 64)}
    assert by_rows[1] >= 3 and by_rows[4] >= 2
    assert by_rows[64] == 0 and by_rows[32] <= 1
    assert list(by_rows.values()) == sorted(by_rows.values(), reverse=True)


def test_current_l_is_kept_unless_the_best_beats_it_by_min_gain():
    flat = StepCost(10.0, 0.0)
    # a = 0.7, c = 0.1: L = 4 is best, L = 3 and 5 within 2 % of it.
    rate = {n: tokens_per_s(flat, 8, 0.7, n, C) for n in (3, 4, 5)}
    assert max(rate[3], rate[5]) > rate[4] / 1.02
    assert fastest_draft_len(flat, 8, 0.7, 3, 0, 8, C, 0.02, 0.03) == 3
    assert fastest_draft_len(flat, 8, 0.7, 5, 0, 8, C, 0.02, 0.03) == 5
    assert fastest_draft_len(flat, 8, 0.7, 3, 0, 8, C, 0.0, 0.03) == 4
    assert fastest_draft_len(flat, 8, 0.7, 1, 0, 8, C, 0.02, 0.03) == 4


# --- the replicas' totals, and the controller's reading of them ---------------------------------------


def test_engine_metrics_count_the_steps_that_verify(llama_pair):
    """A real (tiny, CPU) engine stepped as AsyncEngine steps it, its metrics told after every step: the
    totals count the steps that verified a batch, their rows, exactly the engine's draft tokens, and the
    prompt tokens prefilled beside them; all rows draft at one L here, so the drafter forwards are that L
    per step."""
    target, draft = llama_pair
    engine = small_engine(target, draft, num_speculative_tokens=3)
    metrics = EngineMetrics("engine", "unified")
    *prompts, late = random_prompts(4, VOCAB, 5, 12, seed=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    verify_steps, rows, total_ms = 0, 0, 0.0
    while engine.has_work:
        if verify_steps == 2 and "late" not in engine.scheduler.by_id:  # its prompt is prefilled beside decoding
            engine.add_request("late", late, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        batch_size = len(engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        step_ms = (time.perf_counter() - start) * 1e3
        metrics.on_step(snapshot(engine), step_ms, batch_size)
        verify_steps, rows = verify_steps + (batch_size > 0), rows + batch_size
        total_ms += step_ms if batch_size else 0.0
    totals = metrics.verify_step_totals()
    assert totals["num_steps"] == verify_steps > 0 and totals["rows"] == rows
    assert totals["step_ms"] == pytest.approx(total_ms)
    assert totals["draft_tokens"] == engine.total_stats.num_draft_tokens > 0
    # Steps near a request's max_tokens draft fewer tokens; the rest draft 3.
    assert 1.0 * verify_steps <= totals["draft_forwards"] <= 3.0 * verify_steps
    assert totals["draft_forwards"] == pytest.approx(3.0 * verify_steps, rel=0.35)
    # Prompt tokens launched beside decode steps: the late prompt's; the first prompts ran in a step of their own.
    assert totals["prefill_tokens"] == len(late)


def test_the_engine_times_a_one_token_forward_of_each_model_and_reports_it(llama_pair):
    """What the controller's measured drafter cost comes from: each local model's forward over a batch,
    timed once before serving at 16 and 64 rows, as far as the slots allow (on the CPU here; the same
    code syncs the GPU there)."""
    target, draft = llama_pair
    engine = small_engine(target, draft, max_num_seqs=32)
    assert core_report(engine)["forward_ms"] == {}  # nothing is measured unasked
    measured = engine.measure_forward_costs()
    assert set(measured) == {"target", "draft"}, measured
    assert all(set(by_rows) == {16, 32} and min(by_rows.values()) > 0 for by_rows in measured.values()), measured
    assert core_report(engine)["forward_ms"] == measured
    assert not engine.has_work  # the pad slot only: no request, no slot, no block taken
    assert engine.scheduler.draft_pool.num_used == 0
    nospec = small_engine(target, None)
    assert set(nospec.measure_forward_costs()) == {"target"}


class _TimedRunner:
    """A runner whose one-token forward takes `ms` on `clock`, times 6 while the host is busy."""

    def __init__(self, ms: float, busy, clock: "_Clock"):
        self.ms, self.busy, self.clock = ms, busy, clock
        self.device = torch.device("cpu")
        self.pool = SimpleNamespace(shape=SimpleNamespace(num_slots=64))

    def pad_forward(self, rows, start, q_len, keep_last, prefill):
        self.clock.s += self.ms / 1e3 * (6 if self.busy() else 1)


class _Clock:
    """time.perf_counter as the forwards advance it: a sleep on the 2-core host overshot by milliseconds
    while other processes ran, and the test read its host's load instead of the measurement's order."""

    def __init__(self):
        self.s = 0.0

    def perf_counter(self) -> float:
        return self.s


def test_a_host_busy_for_part_of_the_timing_slows_both_models_alike(monkeypatch):
    """Two equal models, and a host busy with other work for the first half of the measurement: the
    forwards alternate, so their measured ratio stays near 1. Timed one model after the other, the
    first would read 6x the second, and a drafter as large as its target would look 6x cheaper."""
    calls = {"n": 0}
    total = 2 * len(CALIBRATION_ROWS) * (CALIBRATION_REPEATS + 1)

    def busy() -> bool:
        calls["n"] += 1
        return calls["n"] <= total // 2

    clock = _Clock()
    monkeypatch.setattr(forward_cost, "time", clock)
    measured = forward_costs_ms({"target": _TimedRunner(2.0, busy, clock), "draft": _TimedRunner(2.0, busy, clock)})
    assert calls["n"] == total
    for rows in CALIBRATION_ROWS:
        assert 0.5 < measured["draft"][rows] / measured["target"][rows] < 2.0, measured


def test_the_controller_takes_the_drafter_cost_from_the_replicas_reports():
    # Co-located modes: each decode replica reports both models; the medians at 16 rows give the ratio.
    decode = [{"forward_ms": {"target": {16: 6.0, 64: 9.0}, "draft": {16: 1.5, 64: 1.7}}},
              {"forward_ms": {"target": {16: 8.0, 64: 11.0}, "draft": {16: 1.8, 64: 2.0}}},
              {"forward_ms": {"target": {16: 7.0, 64: 10.0}, "draft": {16: 1.6, 64: 1.9}}}]
    assert measured_draft_cost_ratio(decode, []) == pytest.approx(1.6 / 7.0)
    assert drafter_forward_ms(decode) == {16: 1.6, 64: 1.9}
    # pdv: the decode replicas hold the drafter, the verify replicas the target (whose larger pool was
    # measured at other sizes: the nearest to 16 counts).
    pdv = measured_draft_cost_ratio([{"forward_ms": {"draft": {4: 2.0}}}], [{"forward_ms": {"target": {16: 8.0}}}])
    assert pdv == 0.25
    # Nothing to take it from: before the first report, a drafter by prompt lookup (no model), or an
    # older replica that reports no forward_ms; the config's value holds then.
    assert measured_draft_cost_ratio([{"forward_ms": {"draft": {16: 2.0}}}], []) is None
    assert measured_draft_cost_ratio([{"forward_ms": {"target": {16: 8.0}}}], []) is None
    assert measured_draft_cost_ratio([{}], [{}]) is None and drafter_forward_ms([{}]) == {}
    # A drafter as slow as its target is clamped to where ControllerConfig accepts it.
    slow = [{"forward_ms": {"target": {16: 1.0}, "draft": {16: 3.0}}}]
    assert measured_draft_cost_ratio(slow, []) == MAX_DRAFT_COST_RATIO


def test_a_measured_drafter_line_replaces_c_times_the_targets_forward():
    flat = DraftCost.through({16: 1.6, 64: 1.8})
    assert flat.forward_ms(16) == pytest.approx(1.6) and flat.forward_ms(64) == pytest.approx(1.8)
    assert DraftCost.through({8: 2.0}) == DraftCost(2.0, 0.0)  # one size: flat
    assert DraftCost.through({16: 2.0, 64: 1.0}).slope_ms_per_row == 0.0  # noise never makes it cheaper per row
    assert COMPUTE_BOUND.step_ms(64, 4, C, flat) == pytest.approx(35.0 + 4 * flat.forward_ms(64))
    # The fit takes the drafter's measured time out of each sample and recovers the target's line, where
    # the c-model (the drafter taken as c of the target's forward) cannot.
    true_drafter = DraftCost(1.5, 0.002)
    samples = [StepTotals(50, 50 * (COMPUTE_BOUND.forward_ms(rows * (length + 1)) + length * true_drafter.forward_ms(rows)),
                          rows * 50, rows * length * 50, length * 50)
               for rows, length in ((8, 1), (32, 3), (64, 2), (128, 1), (96, 0))]
    fit = fit_step_cost(samples, None, C, SPREAD, true_drafter)
    # (Within 1 %: without a previous fit the slope is pulled slightly toward 0, fit_step_cost.)
    assert fit.t0_ms == pytest.approx(COMPUTE_BOUND.t0_ms, rel=0.01)
    assert fit.slope_ms_per_token == pytest.approx(COMPUTE_BOUND.slope_ms_per_token, rel=0.01)
    c_model = fit_step_cost(samples, None, C, SPREAD)
    assert abs(c_model.t0_ms - COMPUTE_BOUND.t0_ms) > 0.1  # the drafter's 1.5 ms a forward lands in t0


def test_with_the_measured_drafter_speculation_stays_on_where_the_c_model_turned_it_off():
    """The decision of the H200 controller run at 128 in flight (gpu_evidence_h200/controller_spec_trace): the
    fitted target line 4.91 + 0.0492 ms/token, 92 rows, acceptance 0.786, c = 0.286 measured at 16 rows,
    and the drafter's forward measured flat at ~1.6-1.8 ms. c x t(92) = 2.7 ms made L = 1 gain 1 %, under
    the 3 % margin: L = 0, which served 0.86x nospec. The drafter's own 1.8 ms makes L = 1 gain over 5 %."""
    fit, rows, accept, c = StepCost(4.91, 0.0492), 92.0, 0.786, 0.286
    measured = DraftCost.through({16: 1.6, 64: 1.8})
    assert fastest_draft_len(fit, rows, accept, 0, 0, 8, c, 0.02, 0.03) == 0
    assert fastest_draft_len(fit, rows, accept, 0, 0, 8, c, 0.02, 0.03, measured) == 1
    gain = tokens_per_s(fit, rows, accept, 1, c, measured) / tokens_per_s(fit, rows, accept, 0, c, measured)
    assert gain > 1.05


def test_prefill_beside_decode_counts_in_the_fit_and_stays_out_of_the_choice_of_l():
    """Unified launches a prefill chunk beside most decode steps, whose time is in the step's. Charged to the
    verified tokens alone, a chunk that grows with the batch steepens the fitted slope (on an H200, unified's
    0.06-0.08 ms a token against spec's 0.03-0.05) and turns speculation off; counted as tokens of the same
    forward, the line is the target's own, and L = 1 stays on where it pays (gpu_evidence_h200, fifth set)."""
    true, drafter = StepCost(4.5, 0.03), DraftCost(1.3, 0.0016)

    def at(rows: int, prefill_tokens: int) -> StepTotals:  # 50 steps at L = 0
        return StepTotals(50, 50 * true.forward_ms(rows + prefill_tokens), rows * 50, 0, 0.0, prefill_tokens * 50)

    samples = [at(rows, 2 * rows) for rows in (64, 128, 192)]
    fit = fit_step_cost(samples, None, C, SPREAD, drafter)
    assert fit.t0_ms == pytest.approx(true.t0_ms, rel=0.01)
    assert fit.slope_ms_per_token == pytest.approx(true.slope_ms_per_token, rel=0.01)
    assert fastest_draft_len(fit, 128.0, 0.8, 0, 0, 8, C, 0.02, 0.03, drafter) == 1
    blind = fit_step_cost([StepTotals(t.num_steps, t.step_ms, t.rows, 0, 0.0) for t in samples], None, C, SPREAD, drafter)
    assert blind.slope_ms_per_token > 2.5 * true.slope_ms_per_token
    assert fastest_draft_len(blind, 128.0, 0.8, 0, 0, 8, C, 0.02, 0.03, drafter) == 0


def test_the_decode_p95_forgets_a_burst_once_the_load_is_light(llama_pair):
    """The p95 that the controller reads as saturation covers at most the last STEP_WINDOW_STEPS steps:
    a burst's long steps leave it after that many short ones, not only after STEP_WINDOW_S. Seen on an
    H200: 50 ms steps of a burst kept unified's p95 near 50 ms for 10 s at 1 in flight, and speculation off."""
    target, draft = llama_pair
    snap = snapshot(small_engine(target, draft, num_speculative_tokens=3))
    metrics = EngineMetrics("engine", "unified")
    for _ in range(300):
        metrics.on_step(snap, 50.0, 0)
    assert metrics.step_p95_ms() == 50.0
    longest = STEP_WINDOW_STEPS - int(0.95 * STEP_WINDOW_STEPS)  # the steps at or above the p95: 13
    for _ in range(STEP_WINDOW_STEPS - longest):
        metrics.on_step(snap, 5.0, 0)
    assert metrics.step_p95_ms() == 50.0  # 13 burst steps left in the window: the p95 is one of them...
    metrics.on_step(snap, 5.0, 0)
    assert metrics.step_p95_ms() == 5.0  # ...12 now, well within STEP_WINDOW_S


def _replica(replica: str, num_steps: int, step_ms: float, rows: int, draft_tokens: int, forwards: float) -> dict:
    totals = {"replica": replica, "num_steps": num_steps, "step_ms": step_ms, "rows": rows,
              "draft_tokens": draft_tokens, "draft_forwards": forwards}
    return {"waiting": 0, "prefilling": 0, "running": 1, "max_num_seqs": 8, "step_p95_ms": 10.0,
            "num_arrivals": 0, "requests": {}, "step_totals": totals}


def test_signal_reader_turns_step_totals_into_deltas_per_replica():
    reader = SignalReader()
    first = reader.read([_replica("a", 10, 100.0, 40, 80, 20.0), _replica("b", 0, 0.0, 0, 0, 0.0)], [], 0.0)
    assert first.step_totals == [StepTotals(10, 100.0, 40, 80, 20.0)]  # b never stepped: no sample
    second = reader.read([_replica("a", 15, 160.0, 60, 100, 25.0), _replica("b", 4, 30.0, 8, 0, 0.0)], [], 1.0)
    assert second.step_totals == [StepTotals(5, 60.0, 20, 20, 5.0), StepTotals(4, 30.0, 8, 0, 0.0)]
    # a restarted: a new id, totals from 0 again; a replica idle since the last read gives no sample.
    third = reader.read([_replica("a2", 3, 33.0, 6, 0, 0.0), _replica("b", 4, 30.0, 8, 0, 0.0)], [], 2.0)
    assert third.step_totals == [StepTotals(3, 33.0, 6, 0, 0.0)]


@pytest.mark.parametrize("totals", [(1, -1.0, 1, 0, 0.0), (2, 10.0, 1, 0, 0.0), (1, 1.0, 1, -2, 0.0)])
def test_step_totals_reject_impossible_values(totals: tuple):
    with pytest.raises(ValueError):
        StepTotals(*totals)
