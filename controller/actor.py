"""The controller deployment: applies the draft-length policy (controller/policy.py) to the running lanes.

A background task, started in the constructor, runs one decision every `interval_s`:
    1. read: `stats()` broadcast to every DecodeLane replica (and to the VerifyLane in pdv);
    2. signals: `SignalReader` turns those answers into one `LaneSignals` (cumulative counters become
       deltas since the previous read);
    3. decide: `decide(state, signals, config)`;
    4. act: `set_draft_lengths(default, per_request)` broadcast to every decode replica, whenever what the
       replicas report running differs from the decision (so a restarted replica is corrected too);
    5. export: log the decision's reason with the signals; gauge of the decided default L and a counter of
       decisions by load class. The replicas themselves export the L they run (`vpd_draft_length`) and
       the per-request L of every step (`vpd_request_draft_length`).

Signals, as read from the replicas' `stats()`:
    verify_queue_depth      requests admitted to a decode replica that are not yet in a verify batch
                            (waiting for a KV slot + prefilling), summed over decode replicas. This is the
                            same in every mode: in the co-located modes the verify batch is the replica's
                            running set; in pdv the verify lane verifies exactly the decode replicas'
                            running sets, so requests not yet running are the ones queued for it.
    verify_batch_occupancy  pdv: target KV slots in use / target slots of the verify lane (its batch
                            capacity); other modes: running requests / max_num_seqs, over decode replicas.
    decode_step_p95_ms      max over decode replicas of their step-time p95 (the slowest bounds latency).
    arrival_rate_rps        generate() calls on decode replicas since the previous read, per second.
    requests_per_verify_batch  requests in flight (running + waiting + prefilling) per verify batch: pdv:
                            over all decode replicas, per verify replica; other modes: the busiest decode
                            replica's.
    requests                per request: spec-decode counter deltas since the previous read. A request's
                            last steps before it finishes fall between two reads and are not seen.
    slo_pressure            with `slo:` targets: the largest of the decode replicas' TTFT and TPOT p95 (their
                            own window of requests, deployments/telemetry/slo_signals.py) over its target.
    step_totals             per decode replica that stepped since the previous read: its steps that
                            verified a batch, their time, rows, draft tokens and drafter forwards (deltas;
                            the samples of the step-cost model).
"""

import asyncio
import logging
import statistics
import time
from dataclasses import asdict

from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError

from controller.config import ControllerConfig
from controller.policy import Decision, PolicyState, decide
from controller.signals import LaneSignals, RequestDraftStats, StepTotals

# Serve sends the "ray.serve" logger (INFO and up) to the replica's log file; a logger of our own would
# stay at the root's WARNING and drop every decision line.
log = logging.getLogger("ray.serve")

# A stats() call waits for the engine's current step; under CPU load a step can take seconds.
STATS_TIMEOUT_S = 10.0
_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_STEP_TOTALS = ("num_steps", "step_ms", "rows", "draft_tokens", "draft_forwards", "prefill_tokens")
# A measured ratio outside these is a measurement gone wrong (or a drafter as large as its target).
MIN_DRAFT_COST_RATIO, MAX_DRAFT_COST_RATIO = 0.01, 0.95
RATIO_ROWS = 16  # the batch size at which c, the drafter's cost relative to the target's, is read


class SignalReader:
    """Replica stats (cumulative counters) -> `LaneSignals` (deltas since the previous read)."""

    def __init__(self, slo: dict | None = None):
        # `slo:` targets (SloConfig's fields): the replicas' TTFT and TPOT p95 over them become slo_pressure.
        self._targets = {k: (slo or {}).get(k) for k in ("ttft_p95_ms", "tpot_p95_ms") if (slo or {}).get(k)}
        self._counters: dict[str, tuple[int, int, int]] = {}  # request id -> counters at the previous read
        self._step_totals: dict[str, dict] = {}  # replica id -> its step totals at the previous read
        self._arrivals: int | None = None
        self._read_at_s: float | None = None

    def read(self, decode: list[dict], verify: list[dict], now_s: float) -> LaneSignals:
        return LaneSignals(
            verify_queue_depth=sum(s["waiting"] + s["prefilling"] for s in decode),
            verify_batch_occupancy=batch_occupancy(decode, verify),
            decode_step_p95_ms=max(s["step_p95_ms"] or 0.0 for s in decode),
            arrival_rate_rps=self._arrival_rate(sum(s["num_arrivals"] for s in decode), now_s),
            requests_per_verify_batch=requests_per_verify_batch(decode, verify),
            requests=self._request_deltas(decode),
            step_totals=self._step_deltas(decode),
            draft_forward_ms=drafter_forward_ms(decode),
            slo_pressure=self._slo_pressure(decode),
        )

    def _slo_pressure(self, decode: list[dict]) -> float:
        """The largest of the decode replicas' TTFT and TPOT p95 over its target (0 without targets)."""
        return max(((s.get(name) or 0.0) / target for s in decode for name, target in self._targets.items()),
                   default=0.0)

    def _arrival_rate(self, arrivals: int, now_s: float) -> float:
        prev, prev_s = self._arrivals, self._read_at_s
        self._arrivals, self._read_at_s = arrivals, now_s
        if prev is None or now_s <= prev_s:
            return 0.0
        # A restarted replica counts from 0 again: that interval reads low, never negative.
        return max(0, arrivals - prev) / (now_s - prev_s)

    def _request_deltas(self, decode: list[dict]) -> dict[str, RequestDraftStats]:
        current = {rid: tuple(r[k] for k in _COUNTERS) for s in decode for rid, r in s["requests"].items()}
        deltas = {}
        for rid, now in current.items():
            before = self._counters.get(rid, (0, 0, 0))
            deltas[rid] = RequestDraftStats(*(n - b for n, b in zip(now, before)))
        self._counters = current  # finished requests drop out here
        return deltas

    def _step_deltas(self, decode: list[dict]) -> list[StepTotals]:
        current = {s["step_totals"]["replica"]: s["step_totals"] for s in decode}
        deltas = []
        for replica, now in current.items():
            # A replica seen for the first time (or restarted, with a new id) counts from 0.
            before = self._step_totals.get(replica, {})
            delta = StepTotals(*(now.get(k, 0) - before.get(k, 0) for k in _STEP_TOTALS))
            if delta.num_steps > 0:
                deltas.append(delta)
        self._step_totals = current
        return deltas


def measured_draft_cost_ratio(decode: list[dict], verify: list[dict]) -> float | None:
    """The drafter's one-token forward over the target's at RATIO_ROWS rows (or the nearest size each
    measured), each the median over the replicas that hold that model (decode replicas hold the drafter,
    and the target too except in pdv, where the verify replicas do); None until both have been
    reported. Clamped to where ControllerConfig accepts it."""
    drafts, targets = _at_rows(decode, "draft", RATIO_ROWS), _at_rows(decode + verify, "target", RATIO_ROWS)
    if not drafts or not targets:
        return None
    ratio = statistics.median(drafts) / statistics.median(targets)
    return min(MAX_DRAFT_COST_RATIO, max(MIN_DRAFT_COST_RATIO, ratio))


def drafter_forward_ms(decode: list[dict]) -> dict[int, float]:
    """{rows: ms} of the drafter's one-token forward, the median over the decode replicas that measured
    it at those rows; {} where none did."""
    sizes = {rows for s in decode for rows in _forward(s, "draft")}
    return {rows: statistics.median(_at_rows(decode, "draft", rows, exact=True)) for rows in sorted(sizes)}


def _forward(stats: dict, model: str) -> dict[int, float]:
    return (stats.get("forward_ms") or {}).get(model) or {}


def _at_rows(stats: list[dict], model: str, rows: int, exact: bool = False) -> list[float]:
    """Each replica's `model` forward at `rows` rows (at the size nearest to it, unless `exact`)."""
    found = []
    for s in stats:
        if measured := _forward(s, model):
            nearest = min(measured, key=lambda n: abs(n - rows))
            if not exact or nearest == rows:
                found.append(measured[nearest])
    return found


def batch_occupancy(decode: list[dict], verify: list[dict]) -> float:
    if verify:  # pdv: one verify lane holds a target slot for every request of every decode replica
        used, total = sum(v["kv_slots_used"] for v in verify), sum(v["kv_slots_total"] for v in verify)
    else:
        used, total = sum(s["running"] for s in decode), sum(s["max_num_seqs"] for s in decode)
    return min(1.0, used / total) if total else 0.0


def requests_per_verify_batch(decode: list[dict], verify: list[dict]) -> float:
    in_flight = [s["running"] + s["waiting"] + s["prefilling"] for s in decode]
    if verify:  # pdv: the verify lane batches the requests of every decode replica together
        return sum(in_flight) / len(verify)
    # Co-located modes: each decode replica verifies its own running set; the busiest bounds latency.
    return float(max(in_flight))


def desired_lengths(decision: Decision) -> tuple[int, dict[str, int]]:
    """What `set_draft_lengths` gets: a request missing from `per_request` runs at the default, so only
    the exceptions among requests the replicas still hold travel."""
    default = decision.default_draft_len
    running = decision.signals.requests
    return default, {rid: n for rid, n in decision.per_request_draft_len.items() if n != default and rid in running}


def replicas_differ(decode: list[dict], default: int, per_request: dict[str, int]) -> bool:
    """True when some replica runs an L other than the decision's (changed decision, restarted replica)."""
    for s in decode:
        if s["default_draft_len"] != default:
            return True
        if any(r["draft_len"] != per_request.get(rid, default) for rid, r in s["requests"].items()):
            return True
    return False


class ControllerMetrics:
    """What the replicas cannot export: the replicas set their L gauge only when they step, so an idle
    replica would show a stale L; and the load class behind each decision."""

    def __init__(self, mode: str):
        from ray.util.metrics import Counter, Gauge

        self._tags = {"mode": mode}
        self._draft_len = Gauge("vpd_controller_draft_length", "Default draft length L of the last decision.",
                                tag_keys=("mode",))
        self._decisions = Counter("vpd_controller_decisions", "Controller decisions, by load class "
                                  "(saturated, steady, headroom).", tag_keys=("mode", "load"))

    def observe(self, decision: Decision) -> None:
        self._draft_len.set(decision.default_draft_len, tags=self._tags)
        self._decisions.inc(1, tags={**self._tags, "load": str(decision.load)})


class ControllerServer:
    """Holds the policy state; `decode` and `verify` are handles of the lane deployments."""

    def __init__(self, config: dict, mode: str, decode, verify=None, slo: dict | None = None):
        """`slo`: the app's `slo:` targets (SloConfig's fields), where it has them."""
        self.config = ControllerConfig.model_validate(config)
        self.decode, self.verify = decode, verify
        self.policy = PolicyState.initial(self.config)
        self.reader = SignalReader(slo)
        self.metrics = ControllerMetrics(mode)
        self.last: Decision | None = None
        self.num_pushes = 0
        self.draft_cost_ratio = self.config.draft_cost_ratio  # the one the last decision used
        self._lanes_down = False  # the lanes were unavailable at the last attempt (logged once per outage)
        # Kept referenced: the event loop holds tasks only weakly.
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def state(self) -> dict:
        """The last decision, the signals behind it, and how many times L was pushed (for tests, debug
        and GET /v1/controller)."""
        if self.last is None:
            return {"decision_index": 0, "num_pushes": self.num_pushes}
        d = self.last
        return {"decision_index": self.policy.decision_index, "default_draft_len": d.default_draft_len,
                "per_request_draft_len": d.per_request_draft_len, "load": str(d.load),
                "fleet_accept_rate": d.fleet_accept_rate, "draft_len_cap": d.draft_len_cap, "reason": d.reason,
                "step_cost": asdict(d.step_cost) if d.step_cost is not None else None,
                "signals": asdict(d.signals), "num_pushes": self.num_pushes,
                "draft_cost_ratio": self.draft_cost_ratio}

    async def _run(self) -> None:
        while True:
            started_s = time.monotonic()
            try:
                await self.step()
                self._lanes_down = False
            except DeploymentUnavailableError as exc:
                # Normal while the lanes load their models; worth one line, not one per interval.
                if not self._lanes_down:
                    log.warning("controller: waiting for the lanes: %s", exc)
                self._lanes_down = True
            except Exception:
                # A replica restarting or a slow read must not end the control loop: the next decision
                # reads afresh.
                log.exception("controller: decision failed")
            await asyncio.sleep(max(0.0, self.config.interval_s - (time.monotonic() - started_s)))

    async def step(self) -> None:
        """One decision: read, decide, push where replicas differ, log, export."""
        # Both lanes at once: right after a deploy a handle may not know its replicas yet, and a read then
        # waits out its timeout; one after the other, a decision waited out two.
        decode, verify = await gather_or_cancel(
            _broadcast(self.decode, "stats"), _broadcast(self.verify, "stats") if self.verify is not None else _none())
        if not decode:
            return  # no decode replica running yet
        signals = self.reader.read(decode, verify, time.monotonic())
        self.policy, decision = decide(self.policy, signals, self._config_for(decode, verify))
        default, per_request = desired_lengths(decision)
        pushed = replicas_differ(decode, default, per_request)
        if pushed:
            await _broadcast(self.decode, "set_draft_lengths", default, per_request)
            self.num_pushes += 1
        self.last = decision
        self.metrics.observe(decision)
        log.info("controller decision %d%s: %s | signals: verify_queue_depth=%d occupancy=%.2f "
                 "decode_step_p95_ms=%.1f arrival_rate_rps=%.2f requests_per_verify_batch=%.1f requests=%d",
                 self.policy.decision_index, " (pushed)" if pushed else "", decision.reason,
                 signals.verify_queue_depth, signals.verify_batch_occupancy, signals.decode_step_p95_ms,
                 signals.arrival_rate_rps, signals.requests_per_verify_batch, len(signals.requests))

    def _config_for(self, decode: list[dict], verify: list[dict]) -> ControllerConfig:
        """The config with the lanes' measured drafter cost, where it is to be measured and they report it."""
        measured = measured_draft_cost_ratio(decode, verify) if self.config.measure_draft_cost else None
        if measured is None:
            return self.config
        if measured != self.draft_cost_ratio:
            log.info("controller: draft_cost_ratio %.3f, measured by the lanes", measured)
        self.draft_cost_ratio = measured
        return self.config.model_copy(update={"draft_cost_ratio": measured})


async def _none() -> list:
    return []


async def gather_or_cancel(*aws) -> list:
    """`asyncio.gather`, but the first exception cancels the others before it propagates.

    With plain `gather`, a lane whose read fails at once (DeploymentUnavailableError while it loads) left
    the other lane's read running to its timeout, behind the next decision's reads.
    """
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let them finish cancelling
        raise


async def _broadcast(handle, method: str, *args) -> list:
    return await handle.broadcast(method, *args).results_async(timeout_s=STATS_TIMEOUT_S)


# One replica: the policy state is a single sequence of decisions. It does no model work.
ControllerDeployment = serve.deployment(ControllerServer, name="Controller", num_replicas=1,
                                        ray_actor_options={"num_cpus": 0.05})
