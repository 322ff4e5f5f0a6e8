"""Decode lane deployment (pd, pdv), or the whole engine in one replica (unified, spec, nospec)."""

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

import ray
from ray import serve

from controller.planner import DRAFT_LEN, IN_FLIGHT, MAX_NUM_SEQS, TPOT_MS, TTFT_MS
from deployments.channels.peer_calls import EnginePeers
from deployments.channels.remote import PEER_CALL_TIMEOUT_S
from deployments.channels.step_channel import StepChannels, StepEnd, StepTicket
from deployments.placement.gpu_binding import lane_device
from deployments.placement.kv_transfer import Placement
from deployments.replicas.tp_workers import bind_workers, watch_workers, worker_pids
from deployments.routing.leases import replica_lease
from deployments.telemetry.engine_metrics import EngineMetrics
from deployments.telemetry.metrics import read_gpu_stats
from deployments.telemetry.slo_signals import LatencyWindow
from deployments.telemetry.timeline import TIMELINE, replica_report
from lanes.engine.async_engine import AsyncEngine
from lanes.engine.outputs import RequestOutput
from lanes.engine.process import ProcessEngine
from lanes.engine.snapshot import EngineSnapshot, core_report
from lanes.engine.step_trace import start_trace, trace_summary
from lanes.sample.params import ParamError, SamplingParams

log = logging.getLogger(__name__)

# The engine thread drops the GIL in every torch call and at every wait on the GPU, and must then
# win it back from the replica's event-loop and serialisation threads, which may keep it for up to
# the switch interval (Python's default: 5 ms) each time. 0.5 ms bounds each such wait. On the CPU
# machine it moved served nospec from 0.67-0.70 to 0.75 of in process (docs/performance.md); its
# effect on a GPU step is not measured yet.
ENGINE_SWITCH_INTERVAL_S = 0.0005

# An engine that holds requests and has not stepped for this long is wedged (a hung kernel, a
# deadlock): the replica then fails Serve's health check and Serve replaces it. A step is
# milliseconds; the bound is generous for a first step that compiles or captures.
ENGINE_STALL_S = 60.0
TRACE_POLL_S = 0.2  # how often `trace` asks the engine whether its trace is written
PEER_HEALTH_TIMEOUT_S = 3.0


@dataclass
class GenerateError:
    """A request the engine refused; yielded as a value so that the stream ends cleanly."""

    status: int
    message: str
    param: str | None = None


def _lane_state(replies: list[str]) -> str:
    """"ok" when every replica of a lane says so; else what the others say, and how many."""
    problems = [r for r in replies if r != "ok"]
    if not replies:
        return "no replica running"
    return "ok" if not problems else f"{len(problems)} of {len(replies)} replicas: {problems[0]}"


class EngineServer:
    def __init__(self, engine_factory, mode: str, prefill=None, verify=None, stream_interval_s: float = 0.0,
                 max_stream_messages_per_s: float | None = None, engine_process: bool = False,
                 start_workers=None, peer_timeout_s: float = PEER_CALL_TIMEOUT_S, num_gpus: float = 0):
        """`start_workers()`: starts the worker ranks of a tensor-parallel engine in this replica's
        placement group (deployments/replicas/tp_workers.py `ShardWorkers`); the engine, rank 0, is built with
        `tp_address=` the address they meet at. `num_gpus`: the replica's share of GPUs (its lane's)."""
        # In the one-replica modes this replica is all three lanes; in pd and pdv it is the decode lane.
        self.lane = "decode" if mode in ("pd", "pdv") else "engine"
        # The workers are held, so that they live as long as this replica.
        engine_factory, self.shard_workers = bind_workers(engine_factory, start_workers)
        streams = dict(stream_interval_s=stream_interval_s, max_stream_messages_per_s=max_stream_messages_per_s)
        if engine_process:
            # The engine process is no Ray worker: it cannot ask Ray which GPU is this replica's, and with
            # kv_peer_access Ray leaves CUDA_VISIBLE_DEVICES unset, so it saw every GPU and took the first,
            # whichever GPU Ray gave this replica (two H200s: both replicas of a data-parallel app on
            # GPU 0). Bound here, CUDA_VISIBLE_DEVICES names this replica's GPU first, and the engine
            # process inherits it (lanes/engine/process.py passes this process's environment on).
            lane_device(num_gpus)
            # pd's and pdv's engine reach their other lanes through this replica (deployments/channels/peer_calls.py).
            self.metrics = EngineMetrics(self.lane, mode, sample_gpu=False)
            peers = EnginePeers(prefill, verify, peer_timeout_s) if prefill is not None or verify is not None else None
            self.engine = self._start_process(engine_factory, streams, peers)
            self.placement_ = self.engine.info
        else:
            # The engine steps on a thread here; pd's and pdv's reach their other lanes through Ray
            # handles on this replica's event loop.
            self.metrics = EngineMetrics(self.lane, mode)
            self.engine, self.placement_ = self._start_thread(engine_factory, prefill, verify, streams)
        self._last_snap: EngineSnapshot | None = None  # the previous step's, for the step timeline's deltas
        self._streamed = (0, 0)  # the engine's (num_messages, num_coalesced) exported so far
        self.num_arrivals = 0  # generate() calls since start; the controller turns it into a rate
        # The latencies this replica's requests see from here (TTFT: from the call to the first token; TPOT:
        # per token after it), and how many it holds: the planner's and the L controller's signals.
        self.ttft, self.tpot = LatencyWindow(), LatencyWindow()
        self.in_flight = 0
        self._max_num_seqs: int | None = None
        self.peers = {"prefill": prefill, "verify": verify}
        self.channels = StepChannels()  # `stream_channel: step`: one message per step per ingress replica
        self.replica_id = replica_lease()  # what an ingress's subscription names to reach this replica
        self._stopping = False
        self._worker_watch = watch_workers(self.shard_workers, self._lose_workers)

    def _lose_workers(self, reason: str) -> None:
        """On the first worker rank to end, fail what the engine holds (rank 0 would wait on it in a
        collective) and fail the health check, so that Serve replaces this replica and its workers."""
        if not self._stopping:
            self.engine.lose(reason)

    def _start_process(self, engine_factory, streams: dict, peers: EnginePeers | None) -> ProcessEngine:
        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        # Serve starts the constructor on the replica's event loop, which answers the engine's orders.
        links = dict(serve_peer=peers.answer, node_id=node_id, on_record=TIMELINE.record) if peers else {}
        return ProcessEngine(partial(engine_factory, loop=None, prefill=None, verify=None),
                             describe=partial(Placement.of_engine, node_id), on_step=self._on_step,
                             on_idle=self.metrics.on_idle, sampler=read_gpu_stats,
                             on_sample=self.metrics.metrics.export_gpu, **links, **streams)

    def _start_thread(self, engine_factory, prefill, verify, streams: dict) -> tuple[AsyncEngine, Placement]:
        # Serve runs the constructor on the replica's event loop; remote lanes are reached through it.
        loop = asyncio.get_event_loop()
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
        core = engine_factory(loop=loop, prefill=prefill, verify=verify)
        engine = AsyncEngine(core, on_step=self._on_step, on_idle=self.metrics.on_idle, **streams)
        return engine, Placement.of_engine(None, core)

    async def generate(self, prompt: list[int] | str, params: SamplingParams, request_id: str,
                       channel: str | None = None
                       ) -> AsyncIterator[RequestOutput | StepTicket | StepEnd | GenerateError]:
        """Stream a request's chunks. Cancelling the call (client gone) aborts it and frees its slots.

        With `channel` (an ingress replica's, deployments/channels/step_channel.py) only the first chunk comes
        here, as a StepTicket; the others go to that channel, and a StepEnd ends the call."""
        self.num_arrivals += 1
        self.in_flight += 1
        self.ttft.begin(request_id)
        start_s, first_s, tokens = time.time(), None, 0
        ticketed = finished = False
        if channel is not None:
            self.channels.register(channel, request_id)
        try:
            async for out in self.engine.generate(prompt, params, request_id):
                if first_s is None and out.token_ids:
                    first_s = time.time()
                    self.ttft.end(request_id)
                tokens = max(tokens, out.num_output_tokens)
                finished = out.finished
                if channel is None:
                    yield out
                elif not ticketed:
                    ticketed = True
                    yield StepTicket(self.replica_id, out)
                else:
                    self.channels.put(channel, out)
            if ticketed:
                yield StepEnd(delivered=finished)
        except ParamError as exc:
            yield GenerateError(400, str(exc), exc.field)
        finally:
            if channel is not None:
                self.channels.end(channel, request_id, delivered=finished)
            self.in_flight -= 1
            self.ttft.drop(request_id)
            if first_s is not None and tokens > 1:
                self.tpot.add(1e3 * (time.time() - first_s) / (tokens - 1))
            TIMELINE.record("request", start_s, time.time(), first_s=first_s, request_id=request_id)

    async def steps(self, channel: str, lease: str | None = None) -> AsyncIterator[dict[str, RequestOutput]]:
        """An ingress replica's subscription to its channel here: each message holds every output of its
        requests made since the last one (`lease`: this replica's id; lease_router.py routes the call here)."""
        async for batch in self.channels.stream(channel):
            yield batch

    def check_health(self) -> None:
        """Serve's health check: raising marks this replica unhealthy, and Serve replaces it."""
        if (problem := self.engine.problem(ENGINE_STALL_S)) is not None:
            raise RuntimeError(f"{self.lane} lane: {problem}")

    async def pid(self) -> int:
        """This replica's process id (operators, fault tests); the engine's own is in `stats()`."""
        return os.getpid()

    async def shard_pids(self) -> list[int]:
        """The process ids of this replica's tensor-parallel worker ranks 1..N-1 (none at TP = 1)."""
        return await worker_pids(self.shard_workers)

    async def lane_health(self) -> dict[str, str]:
        """This lane's state and, in pd and pdv, whether the other lanes answer: "ok" or why not."""
        states = {self.lane: self.engine.problem(ENGINE_STALL_S) or "ok"}
        for lane, handle in self.peers.items():
            if handle is not None:
                try:
                    # Every replica of the lane (several verify replicas each hold their own requests' KV).
                    replies = await handle.broadcast("health").results_async(timeout_s=PEER_HEALTH_TIMEOUT_S)
                    states[lane] = _lane_state(replies)
                except Exception as exc:
                    states[lane] = f"unreachable ({type(exc).__name__})"
        return states

    async def set_draft_lengths(self, default_len: int, per_request: dict[str, int] | None = None) -> None:
        self.engine.set_draft_lengths(default_len, per_request)

    async def stats(self) -> dict:
        """Slot usage and spec-decode totals of this replica, read between engine steps; `requests` and
        `num_arrivals` are cumulative counters the controller turns into per-interval deltas."""
        report = await self.engine.call(core_report)
        pid = self.engine.pid if isinstance(self.engine, ProcessEngine) else os.getpid()
        return {**report, "step_p95_ms": self.metrics.step_p95_ms(), "step_totals": self.metrics.verify_step_totals(),
                "num_arrivals": self.num_arrivals, "ttft_p95_ms": self.ttft.p95_ms(), "tpot_p95_ms": self.tpot.p95_ms(),
                # Engine steps and the stream messages they became (what benchmarks/stream_latency.py reads),
                # and the process that steps (the one to profile).
                "num_steps": self.engine.num_steps, "num_messages": self.engine.num_messages,
                "num_coalesced": self.engine.num_coalesced, "channel_messages": self.channels.num_messages,
                "step_ms_total": self.engine.step_ms_total, "pid": pid, "replica_pid": os.getpid()}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics of this replica: what the replica planner scales the lane on
        (controller/planner.py), with the L it runs."""
        if self._max_num_seqs is None:
            self._max_num_seqs = (await self.engine.call(core_report))["max_num_seqs"]
        signals = {TTFT_MS: self.ttft.p95_ms(), TPOT_MS: self.tpot.p95_ms(), IN_FLIGHT: self.in_flight,
                   MAX_NUM_SEQS: self._max_num_seqs}
        if self._last_snap is not None:
            signals[DRAFT_LEN] = self._last_snap.default_draft_len
        return signals

    async def trace(self, num_steps: int, out_dir: str, timeout_s: float = 60.0) -> dict:
        """A torch.profiler trace of the engine's next `num_steps` steps, written under `out_dir` on this
        replica's node (lanes/engine/step_trace.py); returns its summary. If the engine has not stepped
        that often within `timeout_s` (no load), the trace ends there with the steps it saw."""
        name = f"{self.lane}-{os.getpid()}"
        await self.engine.call(partial(start_trace, num_steps=num_steps, out_dir=out_dir, name=name))
        deadline_s = time.monotonic() + timeout_s
        while (summary := await self.engine.call(trace_summary)) is None:
            if time.monotonic() >= deadline_s:
                return await self.engine.call(partial(trace_summary, stop=True))
            await asyncio.sleep(TRACE_POLL_S)
        return summary

    async def timeline(self, start_s: float = 0.0, offset: int = 0) -> dict:
        """Where this replica runs and its engine steps (and, in pdv, its waits on the verify lane)
        since `start_s`, one page from `offset` (deployments/telemetry/timeline.py)."""
        return replica_report(self.lane, self.placement_, start_s, offset)

    def _on_step(self, snap: EngineSnapshot, step_ms: float, batch_size: int) -> None:
        end_s = time.time()
        # Besides its rows, what the step prefilled itself, the requests still queued for prefill after
        # it, and whether it ran out of device memory: what sets a co-located engine's batch size.
        last = self._last_snap
        TIMELINE.record("step", end_s - step_ms / 1e3, end_s, rows=batch_size, queued=snap.queue_depth,
                        prefill_tokens=snap.num_prefill_tokens - (last.num_prefill_tokens if last else 0),
                        ooms=snap.num_oom_recoveries - (last.num_oom_recoveries if last else 0))
        self._last_snap = snap
        self.metrics.on_step(snap, step_ms, batch_size)
        # Read off the event loop's counters without a lock: a delta missed now is exported next step.
        streamed = (self.engine.num_messages, self.engine.num_coalesced)
        self.metrics.metrics.record_stream_messages(streamed[0] - self._streamed[0], streamed[1] - self._streamed[1])
        self._streamed = streamed

    def __del__(self):
        self._stopping = True  # its workers stop with the engine: no loss
        self.engine.shutdown()


EngineDeployment = serve.deployment(EngineServer, name="DecodeLane")
