"""A served benchmark's cluster: Ray with Serve's proxy, apps deployed and removed, what their replicas
logged and left on the GPU, and where and how a run was measured."""

import contextlib
import gc
import os
import platform
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import ray
import torch
from ray import serve
from ray.serve.schema import ApplicationStatus

from deployments.builder import build_app

REPO = Path(__file__).resolve().parents[2]
STARTED_S = time.monotonic()


def log(message: str) -> None:
    """A line on stdout, stamped with the seconds since the benchmark started."""
    print(f"[{time.monotonic() - STARTED_S:7.1f} s] {message}", flush=True)


class DeployFailed(RuntimeError):
    """An app did not reach RUNNING; the message says why (Serve's own status message)."""


def start_cluster(env_vars: dict[str, str] | None = None) -> int:
    """A Ray cluster of this machine with Serve's proxy on a free port; returns the port. `env_vars` reach
    every replica (OMP_NUM_THREADS=1 always); `RAY_*` ones are also set here, before Ray starts, as Serve's
    controller and proxy read them from the raylet's environment, inherited from this process."""
    os.environ.update({key: value for key, value in (env_vars or {}).items() if key.startswith("RAY_")})
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", **(env_vars or {})}})
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


@contextlib.contextmanager
def serving(port: int) -> Iterator[int]:
    """`port` (a started cluster's), with Serve and Ray shut down when the block ends, however it ends."""
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def serve_env(throughput_optimized: bool) -> dict[str, str]:
    """Serve's high-throughput settings (Ray >= 2.55, ray/serve/_private/constants.py), or none. An ingress
    replica serving HTTP itself drains 30 s when deleted; a benchmark deletes apps once idle, so 1 s."""
    return {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"} if throughput_optimized else {}


def start_model_cluster(env_vars: dict[str, str] | None = None) -> int:
    """start_cluster for large models: a replica that fails to start is not rebuilt three times (each try
    loads the weights again); Triton compiles for the GPU unless the driver's TRITON_INTERPRET says not."""
    return start_cluster({"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0"),
                          "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1", **(env_vars or {})})


def deploy(name: str, app_args: dict, timeout_s: float) -> float:
    """Deploy `app_args` as app `name` (route /name), wait until it runs, return the seconds taken. Raises
    DeployFailed with Serve's message if it fails or is not running within `timeout_s`, after deleting it."""
    started_s = time.monotonic()
    try:
        serve.run_many([serve.RunTarget(build_app(app_args), name=name, route_prefix=f"/{name}")],
                       wait_for_applications_running=False)
        while True:
            status = serve.status().applications.get(name)
            if status is not None and status.status == ApplicationStatus.RUNNING:
                return time.monotonic() - started_s
            if status is not None and status.status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY):
                raise DeployFailed(" | ".join([f"{name}: {status.status}: {status.message}"] + [
                    f"{dep}: {d.status} {d.message}" for dep, d in status.deployments.items() if d.message]))
            if time.monotonic() - started_s > timeout_s:
                raise DeployFailed(f"{name}: not running after {timeout_s:.0f} s")
            time.sleep(1.0)
    except BaseException:
        serve.delete(name)
        raise


def replica_logs() -> list[Path]:
    """This Ray session's Serve replica logs (replica output does not reach the driver). Ray's private
    API: callers catch its failures, so that it never hides the failure being reported."""
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    return sorted(logs.glob("replica_*.log"))


def replica_log_tail(name: str, lines: int = 25) -> str:
    """The last lines of app `name`'s replica logs."""
    try:
        paths = [p for p in replica_logs() if p.name.startswith(f"replica_{name}_")]
    except Exception as exc:
        return f"(replica logs not found: {exc})"
    return "\n".join(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
                     for path in paths)


def replica_log_lines(wanted: tuple[str, ...], most: int = 400) -> str:
    """Every replica's log lines that contain one of `wanted` (memory plans, refusals, errors)."""
    try:
        paths = replica_logs()
    except Exception as exc:
        return f"(replica logs not found: {exc})"
    lines = [f"{path.name}: {line.strip()}" for path in paths
             for line in path.read_text(errors="replace").splitlines() if any(w in line for w in wanted)]
    return "\n".join(lines[:most])


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_memory_note() -> str:
    if not torch.cuda.is_available():
        return ""
    free, total = torch.cuda.mem_get_info()
    return f"; GPU memory in use {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB"


def wait_for_device_memory(free_bytes: int | None, timeout_s: float = 60) -> None:
    """After an app is deleted, wait until its replicas' memory on the current GPU is back (None, 0: no GPU)."""
    deadline = time.monotonic() + timeout_s
    while free_bytes and torch.cuda.mem_get_info()[0] < 0.95 * free_bytes and time.monotonic() < deadline:
        time.sleep(1)


def machine() -> dict:
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor())
    return {"cpu_model": cpu_model, "cpu_cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "ray": ray.__version__, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def gpu_inventory() -> list[dict]:
    """The driver's view of this host's GPUs: index, name and UUID (replicas report UUIDs)."""
    if not torch.cuda.is_available():
        return []
    return [{"index": i, "name": torch.cuda.get_device_name(i), "uuid": str(torch.cuda.get_device_properties(i).uuid)}
            for i in range(torch.cuda.device_count())]


def topology() -> str | None:
    """`nvidia-smi topo -m`: how the GPUs are linked (NVLink or PCIe) decides what a KV copy costs."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        done = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
        return done.stdout.strip() or None
    return None


def shm_gib() -> float | None:
    """Size of /dev/shm, where Ray's object store lives (copied KV passes through it)."""
    with contextlib.suppress(OSError):
        stat = os.statvfs("/dev/shm")
        return round(stat.f_blocks * stat.f_frsize / 2**30, 1)
    return None


def git_commit() -> str:
    """HEAD, "-dirty" with uncommitted changes; "unknown" without git (the GPU machine gets a copy of the tree)."""
    with contextlib.suppress(OSError):
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=REPO,
                              capture_output=True, text=True)
        return done.stdout.strip() or "unknown"
    return "unknown"
