"""One Ray cluster and one Serve instance for the whole test session, and apps of every mode on the
tiny pair deployed on it once per test module (or kept for the next module that asks for the same)."""

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema

from deployments.builder import build_app

if TYPE_CHECKING:
    from openai import OpenAI


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# A port of our own, so that test modules (or other Serve instances) on this machine never collide.
HTTP_PORT = _free_port()
MODEL = "vpd-python"  # the served model name of app_config's apps
ALL_MODES = ("nospec", "spec", "unified", "pd", "pdv")
LANE = {"num_cpus": 0.05}

RUNTIME_ENV = {"env_vars": {"OMP_NUM_THREADS": "1"}}

_cluster: tuple | None = None  # the settings of the Ray cluster this process runs; None: none
_stop_nodes: Callable[[], None] | None = None  # ends a cluster a module started for itself (`own_cluster`)
_serve_started = False
_deployed: dict[str, dict] = {}  # app name -> config, of every app deployed on it
_shared: set[str] = set()  # those kept by a module that shares its apps (`serving(shared=True)`)


def ray_cluster(num_gpus: int | None = None, env_vars: dict[str, str] | None = None, with_serve: bool = True) -> None:
    """Ray (with Serve on it) as the caller needs it: started once per session and shared by every test
    module that asks for the same settings; restarted for one that asks for others (logical GPUs, a
    Ray setting read from the environment), which conftest.py runs after those that share the default.
    `num_gpus=None`: the GPUs the machine has."""
    global _cluster, _serve_started
    settings = (num_gpus, tuple(sorted((env_vars or {}).items())))
    if _cluster != settings:
        stop_ray()
        # RAY_* settings are read by the raylet and every worker it starts: in the environment as Ray starts.
        with _environment(env_vars or {}):
            # Replica logs stay in Ray's session log files (/tmp/ray/session_latest/logs), out of pytest's output.
            # address="local": a new cluster of this process's own, never one that `ray start` left running
            # on this host (bare ray.init() would join it; tests/fake_cluster.py's autoscaler runs one).
            ray.init(address="local", num_cpus=2, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
                     runtime_env=RUNTIME_ENV)
        _cluster = settings
    if with_serve and not _serve_started:
        _start_serve()
        _serve_started = True


def multinode(head: dict, workers: list[dict]) -> Cluster:
    """A Ray cluster of several nodes on this host, for one module (`own_cluster`): Ray's own
    `cluster_utils.Cluster`, each node a raylet with its own object store (objects between nodes go through
    Ray's object manager, as between hosts), `head` and each of `workers` the arguments of one node
    (num_cpus, resources, ...)."""
    stop_ray()
    node = dict(object_store_memory=96 << 20, include_dashboard=False)  # Ray's least is 75 MiB
    nodes = Cluster(initialize_head=True, head_node_args={**node, **head})
    for worker in workers:
        nodes.add_node(**node, **worker)
    nodes.wait_for_nodes()
    own_cluster(nodes.address, nodes.shutdown)
    return nodes


def own_cluster(address: str, shutdown: Callable[[], None]) -> None:
    """Join a cluster that a module started for itself (several nodes on this host), with Serve on it and its
    HTTP proxy on the head only: on one host every node's proxy would share the port, and a client's
    connection could run through a node a test kills. The session's cluster goes down first; `shutdown`
    ends this one's processes when `stop_ray` runs (the next module that asks for another cluster starts
    its own)."""
    global _cluster, _serve_started, _stop_nodes
    stop_ray()
    _cluster, _stop_nodes = ("own", address), shutdown
    ray.init(address=address, log_to_driver=False, runtime_env=RUNTIME_ENV)
    _start_serve(proxy_location="HeadOnly")
    _serve_started = True


def _start_serve(attempts: int = 3, proxy_location: str = "EveryNode") -> None:
    """serve.start, again after a failure: Serve gives its proxy 60 s to come up, and on the 2-core
    host under load (other test processes, a build beside the suite) the proxy actor once missed it
    and was killed, failing the setup of a whole module's tests."""
    for attempt in range(1, attempts + 1):
        try:
            serve.start(proxy_location=proxy_location, http_options={"host": "127.0.0.1", "port": HTTP_PORT})
            return
        except ray.exceptions.RayError:
            if attempt == attempts:
                raise
            serve.shutdown()  # the controller stays otherwise, with the dead proxy's state


def stop_ray() -> None:
    """Shut down Serve and Ray where this process started them (at the session's end, or for other settings)."""
    global _cluster, _serve_started, _stop_nodes
    if _cluster is not None:
        if _serve_started:
            serve.shutdown()
        ray.shutdown()
        if _stop_nodes is not None:
            _stop_nodes()  # this cluster's processes only (not `ray stop`, which ends every Ray on the host)
        _cluster, _serve_started, _stop_nodes = None, False, None
        _deployed.clear()
        _shared.clear()


@contextlib.contextmanager
def _environment(env_vars: dict[str, str]):
    saved = {name: os.environ.get(name) for name in env_vars}
    os.environ.update(env_vars)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def app_config(mode: str, target: str, draft: str, **overrides) -> dict:
    config = {
        "mode": mode, "target": {"path": target}, "draft": {"path": draft},
        "engine": {"max_model_len": 256, "max_num_seqs": 8, "num_speculative_tokens": 3, "prefill_chunk_tokens": 32},
        "ingress": LANE, "prefill_lane": LANE, "verify_lane": LANE,
        # Two decode replicas in pdv, so that one verify replica merges calls from both.
        "decode_lane": {**LANE, "num_replicas": 2 if mode == "pdv" else 1},
    }
    if mode == "pd":
        # Every prompt through the prefill lane: the path these tests are about. Short prompts prefilled in
        # the decode lane (the default) are tests/test_split_prefill.py's.
        config["local_prefill_max_tokens"] = 0
    if mode == "pdv":
        # Drafts in rings of shared memory, as they go in rings of device memory on a GPU (the default there;
        # lanes/device/shared_drafts.py). test_serve_modes' pdv_split keeps them on the host.
        config["shared_drafts"] = True
    config.update(overrides)
    return config


def deploy(apps: dict[str, dict]) -> None:
    """Deploy several apps at once (route prefix = name) and wait until every one answers."""
    if not apps:
        return
    _deployed.update(apps)
    serve.run_many([serve.RunTarget(build_app(config), name=name, route_prefix=f"/{name}")
                    for name, config in apps.items()], wait_for_applications_running=False)
    wait_answering(apps)


def delete(names) -> None:
    """Delete these apps and wait until they are gone (their replicas stopped)."""
    names = [name for name in names if name in _deployed]
    if not names:
        return
    for name in names:
        del _deployed[name]
        _shared.discard(name)
    _get_global_client().delete_apps(names, blocking=False)
    deadline = time.monotonic() + 300  # Serve's own wait gives up after 60 s, short on a busy host
    while set(names) & set(serve.status().applications):
        assert time.monotonic() < deadline, f"apps not deleted after 300 s: {names}"
        time.sleep(0.5)


def declare(apps: dict[str, dict], deployments: dict[str, list[dict]] | None = None) -> None:
    """Deploy apps as `serve deploy` of a config file does (import path + args), with per-deployment
    options over the builder's (`deployments[app]`, e.g. [{"name": "VerifyLane", "num_replicas": 1}]).
    Declaring the same args again with other deployment options changes only those deployments (Serve's
    lightweight update: other replicas keep running); `serve.run`, or other args, replaces every replica."""
    _deployed.update(apps)
    schema = ServeDeploySchema.model_validate({
        "http_options": {"host": "127.0.0.1", "port": HTTP_PORT},
        "applications": [{"name": name, "route_prefix": f"/{name}", "import_path": "deployments.builder:build_app",
                          "args": config, "deployments": (deployments or {}).get(name, [])}
                         for name, config in apps.items()]})
    _get_global_client().deploy_apps(schema)


def wait_answering(apps) -> None:
    """Wait until every app (by name) answers /health."""
    deadline = time.monotonic() + 600
    pending = set(apps)
    while pending and time.monotonic() < deadline:
        for name in list(pending):
            try:
                # /health answers 200 once the ingress is up and every lane answers it.
                if httpx.get(f"http://127.0.0.1:{HTTP_PORT}/{name}/health", timeout=10).status_code == 200:
                    pending.discard(name)
            except httpx.HTTPError:
                pass
        if pending:
            time.sleep(1)
    assert not pending, f"apps never became ready: {pending}"


@contextlib.contextmanager
def serving(apps: dict[str, dict], shared: bool = False, **cluster):
    """These apps deployed on the session's cluster (`ray_cluster(**cluster)`) and answering.

    Other modules' apps are deleted first, but where this module and theirs share: then the next module
    that asks for an app of the same name and config gets it as it is, without a deploy, and on exit
    this module's apps are kept for it; otherwise they are deleted. Only modules whose tests leave
    an app as they found it (no replica killed, no rescale, no counter read since the replica
    started) share."""
    ray_cluster(**cluster)
    delete([name for name, config in _deployed.items()
            if apps.get(name) != config and not (shared and name in _shared and name not in apps)])
    kept = False
    try:
        deploy({name: config for name, config in apps.items() if name not in _deployed})
        wait_answering(apps)  # the kept ones too
        kept = shared
        yield
    finally:
        if kept:
            _shared.update(apps)
        else:
            delete(apps)


def openai_client(app: str, api_key: str = "unused") -> "OpenAI":
    """The `openai` SDK pointed at one app, without retries (a test sees every failure)."""
    from openai import OpenAI  # here: GPU benchmarks import this module where the openai client is not installed

    return OpenAI(base_url=base_url(app), api_key=api_key, max_retries=0)


def base_url(name: str) -> str:
    return f"http://127.0.0.1:{HTTP_PORT}/{name}/v1"


def lane_stats(app: str, deployment: str) -> list[dict]:
    """`stats()` of every replica of a deployment."""
    return serve.get_deployment_handle(deployment, app_name=app).broadcast("stats").results(timeout_s=30)


def wait_for_replicas(app: str, deployment: str, count: int, timeout_s: float) -> list[dict]:
    """`lane_stats` once the deployment has exactly `count` replicas (after a rescale or a replacement)."""
    deadline = time.monotonic() + timeout_s
    while len(stats := lane_stats(app, deployment)) != count:
        assert time.monotonic() < deadline, f"{len(stats)} {deployment} replicas, not {count}"
        time.sleep(0.5)
    return stats


def decode_state(app: str) -> tuple[set[int], int]:
    """The decode replicas' process ids and the requests they have migrated so far."""
    stats = lane_stats(app, "DecodeLane")
    return {s["replica_pid"] for s in stats}, sum(s["num_migrations"] for s in stats)


def _all_blocks_free(stats: dict) -> bool:
    """No KV block held in any pool a replica reports (cached blocks count as free)."""
    pools = list((stats.get("kv_blocks") or {}).values()) + [(stats.get("kv_blocks_free"), stats.get("kv_blocks_total"))]
    return all(free == total for free, total in pools)


def wait_until_idle(app: str, mode: str, timeout_s: float = 30) -> list[dict]:
    """Poll until no request holds a KV slot or block in any lane of the app; return the last stats read."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = lane_stats(app, "DecodeLane") + (lane_stats(app, "VerifyLane") if mode == "pdv" else [])
        if all(not s.get("kv_slots_used") and not s.get("target_slots_used") and not s.get("running")
               and not s.get("waiting") and not s.get("prefilling") and not s.get("prefills_in_flight")
               and _all_blocks_free(s) for s in stats):
            return stats
        assert time.monotonic() < deadline, f"slots still held: {stats}"
        time.sleep(0.2)


def greedy_choice(app: str, prompt: str, max_tokens: int = 16, **extra) -> dict:
    """The one choice of a greedy, non-streamed completion (ignore_eos: always max_tokens long)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}
    response = httpx.post(f"{base_url(app)}/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def record_stream(app: str, index: int, max_tokens: int, results: list, started: threading.Semaphore,
                  timeout_s: float = 60) -> None:
    """Stream a greedy completion of `def f{index}(x):` and store (ended monotonic s, HTTP status, SSE
    data events) in results[index]. `started` is released once: at the first event, or at the end
    of a stream that had none (refused, or cut before its first token). For a thread per stream."""
    body = {"model": MODEL, "prompt": f"def f{index}(x):", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events, status = [], None
    try:
        with httpx.stream("POST", f"{base_url(app)}/completions", json=body, timeout=timeout_s) as response:
            status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        started.release()
    except httpx.HTTPError as exc:
        if not events:
            started.release()
        events.append(f"transport error {exc!r}")
    else:
        if not events:
            started.release()
    results[index] = (time.monotonic(), status, events)


def kill_under_streams(app: str, pid: int, count: int, max_tokens: int) -> tuple[float, list]:
    """Start `count` greedy streams (`record_stream`), SIGKILL process `pid` once each has its first
    chunk, and wait for every stream to end (none may hang). Returns when the kill was (monotonic s)
    and each stream's (ended monotonic s, HTTP status, SSE data events)."""
    results: list = [None] * count
    started = threading.Semaphore(0)
    threads = [threading.Thread(target=record_stream, args=(app, i, max_tokens, results, started))
               for i in range(count)]
    for t in threads:
        t.start()
    for _ in threads:  # every stream is under way (or was refused)
        assert started.acquire(timeout=120)
    killed_s = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    return killed_s, results


@dataclass
class Streamed:
    """One streamed greedy completion: its token ids, when each chunk arrived (monotonic s), its error."""

    tokens: list[int] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)
    error: str | None = None

    def stall_s(self, after_s: float) -> float:
        """The longest wait for a chunk that arrived after `after_s` (0 if none did)."""
        return max((b - a for a, b in zip(self.times_s, self.times_s[1:]) if b >= after_s), default=0.0)


async def stream_greedy(http: httpx.AsyncClient, app: str, prompt: list[int], max_tokens: int,
                        first: asyncio.Event) -> Streamed:
    """Stream a greedy completion of token ids; `first` is set at its first chunk (or at its end)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    out = Streamed()
    try:
        async with http.stream("POST", f"{base_url(app)}/completions", json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}"
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = event["error"]["message"]
                    continue
                out.tokens += event["choices"][0].get("token_ids") or []
                out.times_s.append(time.monotonic())
                first.set()
    finally:
        first.set()
    return out


def streams_across(app: str, prompts: list[list[int]], max_tokens: int, action: Callable[[], object],
                   repeat: bool = False) -> tuple[object, float, list[list[Streamed]]]:
    """Stream greedy completions of `prompts`; once every one has its first token (its prompt's KV is
    placed), run `action()` in a thread. With `repeat`, each prompt is streamed again as soon as its
    stream ends, until `action` has returned, so that streams are in flight all the while. Returns
    what `action` returned, when it began, and each prompt's streams."""
    async def run():
        async with httpx.AsyncClient(timeout=600) as http:
            firsts = [asyncio.Event() for _ in prompts]
            acted = asyncio.Event()

            async def streams_of(prompt: list[int], first: asyncio.Event) -> list[Streamed]:
                out = [await stream_greedy(http, app, prompt, max_tokens, first)]
                while repeat and not acted.is_set():
                    out.append(await stream_greedy(http, app, prompt, max_tokens, asyncio.Event()))
                return out

            tasks = [asyncio.create_task(streams_of(p, e)) for p, e in zip(prompts, firsts)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
            acted_s = time.monotonic()
            result = await asyncio.to_thread(action)
            acted.set()
            return result, acted_s, await asyncio.gather(*tasks)

    return asyncio.run(run())
