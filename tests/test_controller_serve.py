"""The draft-length controller on a real Serve instance (CPU, tiny models): a change of acceptance or of
load changes the L that the decode replicas run, within the bounds stated here.

Every app decides every INTERVAL_S = 0.5 s. The policy needs a handful of decisions for each move (a
first measurement, then `raise_dwell` = 3 or `lower_dwell` = 2 decisions before L moves, `max_step` = 2
per decision), so each move below is expected within about 3 s; the bound MOVE_BOUND_S = 20 s leaves room
for a 2-core machine shared with other work. L is read from the replicas' own `stats()`, not from the
controller: what is asserted is the L the decode lane runs.
"""

import asyncio
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from controller.actor import measured_draft_cost_ratio
from controller.config import ControllerConfig
from deployments.builder import ConfigError, build_app
from lanes.model.loader import load_model
from tests.conftest import perturbed_copy
from tests.serve_helpers import MODEL, app_config, base_url, lane_stats, serving
from tests.tiny_pair import save_tiny_pair

pytestmark = pytest.mark.serve

INTERVAL_S = 0.5
MOVE_BOUND_S = 20.0
MAX_DRAFT_LEN = 8
CONTROLLER = {
    "interval_s": INTERVAL_S, "max_draft_len": MAX_DRAFT_LEN, "raise_dwell": 3, "lower_dwell": 2, "max_step": 2,
    # Latency is not under test here: a target no CPU step reaches leaves the queue as the only load signal.
    "target_decode_p95_ms": 60_000,
}


@pytest.fixture(scope="module")
def pair_paths(tmp_path_factory) -> tuple[str, str, str]:
    """Target, a draft equal to the target (acceptance 1), and a draft unrelated to it (acceptance ~0)."""
    root = tmp_path_factory.mktemp("pair")
    target, _ = save_tiny_pair(root)
    loaded = load_model(target)
    # Noise of 4 standard deviations on every weight leaves nothing of the target.
    unrelated = perturbed_copy(loaded, 4.0, seed=11)
    bad = root / "unrelated"
    unrelated.model.save_pretrained(bad)
    loaded.tokenizer.save_pretrained(bad)
    return target, target, str(bad)


@pytest.fixture(scope="module", autouse=True)
def apps(pair_paths):
    target, same, unrelated = pair_paths
    with serving({
        # Without the step-cost model in "good" and "bad": with the target as its own drafter every draft
        # token costs a target forward, and with an unrelated drafter no draft is accepted, so in both no
        # L > 0 beats L = 0 on wall time and the model (rightly) turns speculation off; these two tests are
        # about what acceptance does to L. The model runs in "load".
        # Both with the drafter cost as configured (0.1): this drafter is the target itself, whose measured
        # cost (~1) makes L = 1 the fastest at any acceptance short of exactly 1, rightly; "bad" measures it.
        "good": app_config("unified", target, same,
                           controller={**CONTROLLER, "initial_draft_len": 2, "step_cost_enabled": False,
                                       "measure_draft_cost": False}),
        # accept_lower_below = 0: the default L never falls for acceptance, so what falls is the
        # per-request L alone. lower_dwell = 1 and max_step = 3: 4 -> 1 at the first decision that sees a
        # request's drafts fail. A 200-token request at acceptance ~0 now lasts about 0.5 s, one decision,
        # and 4 -> 2 -> 1 after a dwell of 2 needs it to live through three.
        "bad": app_config("unified", target, unrelated,
                          controller={**CONTROLLER, "initial_draft_len": 4, "accept_lower_below": 0.0,
                                      "lower_dwell": 1, "max_step": 3, "step_cost_enabled": False}),
        # Two decode replicas of 4 slots each: 24 requests in flight leave 16 queued >= verify_queue_high.
        # Without the step-cost model too: with it, a saturated queue sheds L only down to the L the model
        # makes fastest (tests/test_controller_policy.py), and this drafter's measured cost (~1) would keep
        # speculation off once the queue drains. The test is about what the queue alone does to L.
        "load": app_config("pdv", target, same, engine={"max_model_len": 256, "max_num_seqs": 4,
                                                       "num_speculative_tokens": 4, "prefill_chunk_tokens": 32},
                           controller={**CONTROLLER, "initial_draft_len": 4, "verify_queue_high": 6,
                                       "verify_queue_low": 2, "measure_draft_cost": False,
                                       "step_cost_enabled": False}),
    }):
        for app in ("good", "bad", "load"):
            wait_reading(app)
        yield


def wait_reading(app: str, bound_s: float = 60.0) -> None:
    """Until `app`'s controller has read its lanes once: the moves below are timed from there. Just after a
    deploy, the controller's handles may not know a lane's replicas yet (Serve tells a handle of replicas
    by long poll), and a read of a lane whose replicas it does not know waits out its timeout (10 s); on
    this 2-core machine that once cost the first decision 21 s, and a test that started its load at once
    saw no decision within its bound."""
    deadline = time.monotonic() + bound_s
    while controller_state(app)["decision_index"] == 0:
        assert time.monotonic() < deadline, f"{app}: the controller read no lane within {bound_s} s"
        time.sleep(0.2)


class Load:
    """`concurrency` clients sending completions back to back until stopped; every answer is kept."""

    def __init__(self, app: str, concurrency: int, max_tokens: int):
        self.app, self.concurrency, self.max_tokens = app, concurrency, max_tokens
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_sending()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "load did not drain"

    def stop_sending(self) -> None:
        """No new requests; those in flight run to their end."""
        self._stop.set()

    async def _main(self) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(self._client(http, i) for i in range(self.concurrency)))

    async def _client(self, http: httpx.AsyncClient, worker: int) -> None:
        i = 0
        while not self._stop.is_set():
            r = await http.post(f"{base_url(self.app)}/completions", json={
                "model": MODEL, "prompt": f"def f{worker}_{i}(x):", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True})
            self.statuses.append(r.status_code)
            if r.status_code != 200:
                self.errors.append(f"{r.status_code}: {r.text[:500]}")
            i += 1


def wait_for(app: str, condition: Callable[[list[dict]], bool], bound_s: float) -> float:
    """Seconds until `condition(stats of every decode replica)` holds; fails past `bound_s`."""
    start = time.monotonic()
    while True:
        stats = lane_stats(app, "DecodeLane")
        if condition(stats):
            return time.monotonic() - start
        assert time.monotonic() - start < bound_s, f"not within {bound_s} s: {summary(stats)}"
        time.sleep(0.2)


def summary(stats: list[dict]) -> list[dict]:
    return [{"default_draft_len": s["default_draft_len"], "waiting": s["waiting"], "running": s["running"],
             "request_draft_lens": sorted(r["draft_len"] for r in s["requests"].values())} for s in stats]


def controller_state(app: str) -> dict:
    r = httpx.get(f"{base_url(app)}/controller", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_acceptance_one_raises_default_l_to_max():
    def at_max(stats: list[dict]) -> bool:
        return all(s["default_draft_len"] == MAX_DRAFT_LEN for s in stats) and any(
            r["draft_len"] == MAX_DRAFT_LEN and r["num_drafts"] > 0 for s in stats for r in s["requests"].values())

    with Load("good", concurrency=2, max_tokens=160) as load:
        took_s = wait_for("good", at_max, MOVE_BOUND_S)
        # A decision whose interval saw no request draft (each one started and ended between two
        # reads, or had only just started) has no fleet rate: read the next decision that has one.
        deadline = time.monotonic() + MOVE_BOUND_S
        while (state := controller_state("good"))["fleet_accept_rate"] is None and time.monotonic() < deadline:
            time.sleep(INTERVAL_S / 2)
    assert set(load.statuses) == {200}, load.errors
    assert state["default_draft_len"] == MAX_DRAFT_LEN and state["load"] == "headroom", state
    assert state["fleet_accept_rate"] > 0.9, state
    print(f"default L 2 -> {MAX_DRAFT_LEN} on replicas after {took_s:.1f} s")


def test_failing_drafts_shorten_per_request_l_below_the_default():
    def shortened(stats: list[dict]) -> bool:
        drafted = [r for s in stats for r in s["requests"].values() if r["num_drafts"] > 0]
        return all(s["default_draft_len"] == 4 for s in stats) and any(r["draft_len"] == 1 for r in drafted)

    with Load("bad", concurrency=2, max_tokens=200) as load:
        took_s = wait_for("bad", shortened, MOVE_BOUND_S)
        state = controller_state("bad")
    assert set(load.statuses) == {200}, load.errors
    assert state["fleet_accept_rate"] < 0.3, state
    # The drafter's cost is the replicas' measurement (a drafter as large as its target: about 1,
    # clamped), not the config's 0.1.
    stats = lane_stats("bad", "DecodeLane")
    assert all(set(s["forward_ms"]) == {"target", "draft"} for s in stats), stats
    assert state["draft_cost_ratio"] == pytest.approx(measured_draft_cost_ratio(stats, []), rel=1e-6)
    assert state["draft_cost_ratio"] > 2 * ControllerConfig().draft_cost_ratio, state
    print(f"per-request L 4 -> 1 on replicas after {took_s:.1f} s")


def test_queue_over_verify_queue_high_turns_speculation_off_and_back_on():
    def speculation_off(stats: list[dict]) -> bool:
        return all(s["default_draft_len"] == 0 for s in stats)

    def speculation_on(stats: list[dict]) -> bool:
        return all(s["default_draft_len"] >= 1 for s in stats)

    assert len(lane_stats("load", "DecodeLane")) == 2
    # pdv: the decode replicas time the drafter, the verify replica the target (the controller's ratio).
    assert all(set(s["forward_ms"]) == {"draft"} for s in lane_stats("load", "DecodeLane"))
    assert all(set(s["forward_ms"]) == {"target"} for s in lane_stats("load", "VerifyLane"))
    with Load("load", concurrency=24, max_tokens=48) as load:
        off_s = wait_for("load", speculation_off, MOVE_BOUND_S)
        state = controller_state("load")
        assert state["load"] == "saturated"
        # The replicas' step totals reach the controller's signals, one entry a decode replica that stepped
        # (what the step-cost model is fitted to: the fit itself, tests/test_cost_model.py).
        totals = state["signals"]["step_totals"]
        assert totals and all(t["num_steps"] > 0 and t["step_ms"] > 0 and t["rows"] > 0 for t in totals), state
        assert state["step_cost"] is None  # the model is off in this app
        load.stop_sending()
        # The queue empties as the requests in flight finish (at L = 0); then L must come back.
        on_s = wait_for("load", speculation_on, MOVE_BOUND_S)
    assert set(load.statuses) == {200}, load.errors
    print(f"L 4 -> 0 after {off_s:.1f} s under load, back to >= 1 {on_s:.1f} s after sending stopped")


def test_controller_without_a_draft_model_is_refused(pair_paths):
    target, _, _ = pair_paths
    with pytest.raises(ConfigError, match="nospec"):
        build_app(app_config("nospec", target, target, controller={"enabled": True}))
