"""Kill a lane replica's process, or its whole node, under load, and account for every stream.

The same harness serves the CPU tests (tests/test_lane_faults.py) and a GPU run: it finds a lane's
replica processes in Ray's actor table (Serve names a replica's actor `ServeReplica:<app>:<deployment>`),
so it needs a driver connected to the cluster (`ray.init(address="auto")`) but no handle into the app,
and kills them with SIGKILL on whatever node they run. Around the kill it measures what a user of the
app would see:

- every stream in flight at the kill, and every stream sent after it, ends: completed, or with an error
  (`RequestRecord.status`), and when (seconds after the kill);
- the app answers /health again, and when;
- greedy outputs after recovery equal the same requests' outputs before the kill;
- device memory (NVML, where a GPU is present) before the kill and after recovery: each lane's
  processes, and the whole GPU's use (which also counts memory that a dead process left mapped in
  a peer, as a KV pool shared by CUDA IPC can be).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from loadtest.client import send_request
from loadtest.memory import device_used_mib, gpu_mib_by_pid
from loadtest.records import STATUSES, RequestRecord
from loadtest.workload import WorkloadRequest


@dataclass(frozen=True)
class LaneProcess:
    """One live replica process of a deployment, as Ray's actor table lists it."""

    app: str
    deployment: str
    pid: int
    node_id: str
    actor_id: str


def lane_processes(app: str, deployment: str) -> list[LaneProcess]:
    """The live replica processes of `deployment` in `app`.

    Read from the GCS's actor table: `ray.util.state.list_actors` says the same but needs Ray's
    dashboard, which test clusters (and many production ones) run without."""
    from ray._private.state import state  # the GCS client behind ray.util.state; no dashboard needed

    wanted = f"ServeReplica:{app}:{deployment}"
    return sorted((LaneProcess(app, deployment, info["Pid"], info["Address"]["NodeID"], actor_id)
                   for actor_id, info in state.actor_table(None).items()
                   if info.get("ActorClassName") == wanted and info.get("State") == "ALIVE" and info.get("Pid")),
                  key=lambda p: p.pid)


def kill(process: LaneProcess) -> None:
    """SIGKILL the process: here if it runs on this node, else by a task placed on its node."""
    if process.node_id == ray.get_runtime_context().get_node_id():
        os.kill(process.pid, signal.SIGKILL)
        return
    strategy = NodeAffinitySchedulingStrategy(process.node_id, soft=False)
    ray.get(_kill_on_node.options(scheduling_strategy=strategy).remote(process.pid), timeout=30)


@ray.remote(num_cpus=0)
def _kill_on_node(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def kill_node(process: LaneProcess) -> None:
    """SIGKILL every Ray process of the node `process` runs on, as a lost machine: its raylet (with the
    node's object store) first, so that nothing on the node reports its workers' deaths, then everything
    under it (workers, replicas' engine processes, agents). A task placed on that node does it, so the
    node may be any host of the cluster; it ends with the node."""
    strategy = NodeAffinitySchedulingStrategy(process.node_id, soft=False)
    try:
        ray.get(_kill_own_node.options(scheduling_strategy=strategy).remote(), timeout=30)
    except ray.exceptions.RayError:
        pass  # the task died with its node: the expected end


@ray.remote(num_cpus=0, max_retries=0)
def _kill_own_node() -> None:
    kill_raylet_tree(int(os.environ["RAY_RAYLET_PID"]))  # set by Ray in every worker: this one dies too


def kill_raylet_tree(raylet_pid: int) -> None:
    """SIGKILL a raylet, then every process under it, this one last if it is among them."""
    import psutil  # Ray's own dependency

    raylet = psutil.Process(raylet_pid)
    under = raylet.children(recursive=True)
    for victim in [raylet, *(p for p in under if p.pid != os.getpid())]:
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    if any(p.pid == os.getpid() for p in under):
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class KillResult:
    """What one kill under load did, every stream counted. Times are seconds after the kill."""

    process: LaneProcess
    in_flight: list[RequestRecord]  # streams under way at the kill
    after: list[RequestRecord]  # streams sent `late_after_s` after it
    late_after_s: float
    killed_perf_s: float  # time.perf_counter() at the kill: later waits are dated from it
    # /health answered 200 again: the first answer seen, polled every 0.5 s once every stream ended
    # (None: not within the wait).
    recovered_s: float | None = None
    # The deployment had as many live processes as before again, none the killed one, and the killed
    # one held no device memory (None: not within the wait).
    replaced_s: float | None = None
    greedy_equal: bool | None = None  # outputs after recovery equal those before (None: not checked)
    device_mib_before: float | None = None  # memory the app's processes held on the GPUs (None: no GPU)
    device_mib_after: float | None = None
    lane_mib_before: dict[str, float] | None = None  # the same by deployment
    lane_mib_after: dict[str, float] | None = None
    device_used_mib_before: float | None = None  # the GPUs' whole use, whoever holds it
    device_used_mib_after: float | None = None
    notes: list[str] = field(default_factory=list)

    def ends_s(self, records: list[RequestRecord], since_s: float = 0.0) -> list[float]:
        """When each record's stream ended, in seconds after `since_s` (the kill, by default)."""
        return [r.end_s - since_s for r in records]

    def summary(self) -> dict:
        """A flat dict for a results table: counts, the slowest end, recovery, greedy check, memory."""
        return {
            "app": self.process.app, "deployment": self.process.deployment, "pid": self.process.pid,
            **{f"in_flight_{k}": v for k, v in _counts(self.in_flight).items()},
            **{f"after_{k}": v for k, v in _counts(self.after).items()},
            "in_flight_last_end_s": round(max(self.ends_s(self.in_flight), default=0.0), 2),
            # A later stream's bound runs from its own start, not from the kill.
            "after_longest_s": round(max((r.end_s - r.start_s for r in self.after), default=0.0), 2),
            "recovered_s": None if self.recovered_s is None else round(self.recovered_s, 1),
            "replaced_s": None if self.replaced_s is None else round(self.replaced_s, 1),
            "greedy_equal": self.greedy_equal,
            "device_mib_before": self.device_mib_before, "device_mib_after": self.device_mib_after,
            "lane_mib_before": self.lane_mib_before, "lane_mib_after": self.lane_mib_after,
            "device_used_mib_before": self.device_used_mib_before, "device_used_mib_after": self.device_used_mib_after,
        }

    def to_dict(self) -> dict:
        return {"summary": self.summary(), "process": asdict(self.process), "notes": self.notes,
                "in_flight": [r.to_row() for r in self.in_flight], "after": [r.to_row() for r in self.after]}


def _counts(records: list[RequestRecord]) -> dict[str, int]:
    return {status: sum(r.status == status for r in records) for status in STATUSES}


async def kill_under_streams(base_url: str, model: str, process: LaneProcess, requests: list[WorkloadRequest],
                             late: list[WorkloadRequest] = (), late_after_s: float = 1.0,
                             timeout_s: float = 120.0, headers: dict | None = None,
                             stop: Callable[[LaneProcess], None] = kill) -> KillResult:
    """Stream `requests` (greedy, ignore_eos), kill `process` once each is under way (its first
    chunk, or its end), send `late` `late_after_s` later, and wait for every stream to end (or time
    out after `timeout_s`). Record times are seconds after the kill. `stop`: how it is killed (`kill`:
    the process alone; `kill_node`: its whole node)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), headers=headers) as http:
        under_way = [asyncio.Event() for _ in requests]
        origin_s = time.perf_counter()
        tasks = [asyncio.ensure_future(_stream(http, base_url, model, r, i, timeout_s, origin_s, event))
                 for i, (r, event) in enumerate(zip(requests, under_way))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in under_way)), timeout_s)
        killed_s = time.perf_counter()
        await asyncio.to_thread(stop, process)
        await asyncio.sleep(max(0.0, late_after_s - (time.perf_counter() - killed_s)))
        late_tasks = [asyncio.ensure_future(_stream(http, base_url, model, r, len(requests) + i, timeout_s, killed_s))
                      for i, r in enumerate(late)]
        in_flight = await asyncio.gather(*tasks)
        after = list(await asyncio.gather(*late_tasks))
    since_kill = killed_s - origin_s
    for record in in_flight:  # relative to the kill, as the late ones already are
        record.start_s -= since_kill
        record.end_s -= since_kill
    return KillResult(process, list(in_flight), after, late_after_s, killed_s)


async def _stream(http: httpx.AsyncClient, base_url: str, model: str, request: WorkloadRequest, index: int,
                  timeout_s: float, origin_s: float, under_way: asyncio.Event | None = None) -> RequestRecord:
    payload = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    return await send_request(http, base_url, payload, index=index, request=request, endpoint="completions",
                              timeout_s=timeout_s, origin_s=origin_s, under_way=under_way)


def wait_healthy(base_url: str, timeout_s: float, headers: dict | None = None) -> float | None:
    """Seconds until the app's /health answers 200 (None: not within `timeout_s`)."""
    start_s = time.monotonic()
    while time.monotonic() - start_s < timeout_s:
        try:
            if httpx.get(f"{base_url}/health", timeout=10, headers=headers).status_code == 200:
                return time.monotonic() - start_s
        except httpx.HTTPError:
            pass  # the ingress itself may be the replica being replaced
        time.sleep(0.5)
    return None


def wait_replaced(result: KillResult, replicas: int, timeout_s: float) -> float | None:
    """Seconds from the kill until the killed process's deployment has `replicas` live processes
    again, none of them the killed one, and NVML lists no device memory under the killed pid (None:
    not within `timeout_s`). With several replicas /health answers before the replacement is up."""
    killed = result.process
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        live = {p.pid for p in lane_processes(killed.app, killed.deployment)}
        if len(live) >= replicas and killed.pid not in live and killed.pid not in gpu_mib_by_pid():
            return time.perf_counter() - result.killed_perf_s
        time.sleep(0.5)
    return None


def greedy_texts(base_url: str, model: str, prompts: list[str], max_tokens: int,
                 headers: dict | None = None) -> list[str]:
    """Each prompt's greedy completion (one request each, not streamed)."""
    texts = []
    with httpx.Client(timeout=120, headers=headers) as http:
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            response = http.post(f"{base_url}/v1/completions", json=body)
            response.raise_for_status()
            texts.append(response.json()["choices"][0]["text"])
    return texts


def lane_device_mib(app: str, deployments: list[str]) -> dict[str, float] | None:
    """Device memory each deployment's live processes hold over this node's GPUs (None without NVML
    or a GPU)."""
    used = gpu_mib_by_pid()
    if not used:
        return None
    return {name: round(sum(used.get(p.pid, 0.0) for p in lane_processes(app, name)), 1) for name in deployments}


def _total(lanes: dict[str, float] | None) -> float | None:
    return None if lanes is None else round(sum(lanes.values()), 1)


def kill_and_recover(base_url: str, model: str, app: str, deployment: str, deployments: list[str],
                     requests: list[WorkloadRequest], late: list[WorkloadRequest], greedy_prompts: list[str],
                     greedy_max_tokens: int = 32, late_after_s: float = 1.0, recover_timeout_s: float = 180.0,
                     headers: dict | None = None, stop: Callable[[LaneProcess], None] = kill) -> KillResult:
    """The whole experiment for one lane: greedy outputs and device memory before; a kill of the
    lane's first replica under `requests` (and `late` after it); the wait for /health, then for the
    killed replica's replacement and its memory's release (wait_replaced); greedy outputs and device
    memory after. `deployments`: every lane of the app, whose processes' memory counts."""
    processes = lane_processes(app, deployment)
    if not processes:
        raise RuntimeError(f"no live replica of {deployment} in app {app}")
    before = greedy_texts(base_url, model, greedy_prompts, greedy_max_tokens, headers)
    lanes_before, used_before = lane_device_mib(app, deployments), device_used_mib()
    result = asyncio.run(kill_under_streams(base_url, model, processes[0], requests, late, late_after_s,
                                            headers=headers, stop=stop))
    # /health is waited for from the kill: the streams' own wait already counts towards it.
    waited_s = max(result.ends_s(result.in_flight + result.after), default=0.0)
    healthy_s = wait_healthy(base_url, recover_timeout_s, headers)
    result.recovered_s = None if healthy_s is None else waited_s + healthy_s
    if result.recovered_s is None:
        result.notes.append(f"/health did not answer 200 within {recover_timeout_s:g} s of the streams' end")
        return result
    result.replaced_s = wait_replaced(result, len(processes), recover_timeout_s)
    if result.replaced_s is None:
        result.notes.append(f"{deployment} was not back to {len(processes)} replicas, or the killed pid still held "
                            f"device memory, {recover_timeout_s:g} s after /health answered")
    try:
        result.greedy_equal = greedy_texts(base_url, model, greedy_prompts, greedy_max_tokens, headers) == before
    except httpx.HTTPError as exc:  # healthy, yet not serving: that is the finding, the streams' records stay
        result.greedy_equal = False
        result.notes.append(f"greedy requests after recovery failed: {type(exc).__name__}: {exc}")
    lanes_after = lane_device_mib(app, deployments)
    result.lane_mib_before, result.lane_mib_after = lanes_before, lanes_after
    result.device_mib_before, result.device_mib_after = _total(lanes_before), _total(lanes_after)
    result.device_used_mib_before, result.device_used_mib_after = used_before, device_used_mib()
    return result
