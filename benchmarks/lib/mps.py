"""NVIDIA's Multi-Process Service for a benchmark run: lanes that share one GPU as separate processes.

Without MPS the driver time-slices the GPU between processes: a kernel of the prefill lane and
one of the decode lane never run at once, and a decode step waits out another process's slice.
Under MPS every process's work goes through one server context, so kernels of different lanes
run side by side (what unified gets inside its one process). Only the control daemon is started
here: no setting of the card changes (compute mode stays as found), and the daemon is told to quit
when the run ends.

    with mps_daemon(Path("/tmp/mps")) as env:   # before the first CUDA call of this process
        start_model_cluster(env)                 # replicas inherit the pipe directory
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
STALE_WAIT_S = 90.0  # how long a new run waits for an earlier run's daemon to go
STALE_POLL_S = 2.0


class MPSUnavailable(RuntimeError):
    """The MPS control daemon is not installed here or did not start."""


def _control(command: str, env: dict[str, str], timeout_s: float = 20.0) -> str:
    done = subprocess.run([CONTROL], input=command + "\n", capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=timeout_s)
    return done.stdout.strip()


def server_pids(env: dict[str, str]) -> list[int]:
    """The MPS servers running under this daemon (one once a client has connected)."""
    return [int(pid) for pid in _control("get_server_list", env).split() if pid.isdigit()]


@contextlib.contextmanager
def mps_daemon(directory: Path) -> Iterator[dict[str, str]]:
    """Start the MPS control daemon with its pipes and logs under `directory`, export the
    variables that make this process and its children MPS clients, and yield them (to pass to
    Ray's runtime_env too). Must run before this process makes a CUDA context."""
    if shutil.which(CONTROL) is None:
        raise MPSUnavailable(f"{CONTROL} is not on PATH")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(directory / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(directory / "log")}
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    started = _start(env)
    deadline_s = time.monotonic() + STALE_WAIT_S
    while started.returncode != 0 and time.monotonic() < deadline_s:
        # An earlier run's daemon that outlived its quit: it waits for its clients (Ray's workers) to exit, and
        # a `-d` meanwhile exits 1 with nothing on stderr (twice on a warm H200, 2026-11-29). Ask it again and
        # wait for it to go.
        _quit_stale(env)
        time.sleep(STALE_POLL_S)
        started = _start(env)
    if started.returncode != 0:
        raise MPSUnavailable(f"{CONTROL} -d exited {started.returncode}: {started.stderr.strip()}")
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        try:  # quit waits for its clients: Ray's replicas may still be exiting after ray.shutdown()
            _control("quit", env, timeout_s=60.0)
        except subprocess.TimeoutExpired:  # the results are written; the daemon then goes with the machine
            pass


def _start(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([CONTROL, "-d"], env={**os.environ, **env}, capture_output=True, text=True)


def _quit_stale(env: dict[str, str]) -> None:
    """Ask a daemon still running on these pipes to quit (its run's `quit` timed out while its clients were
    exiting: a second `-d` on a warm machine then exited 1, 2026-11-28)."""
    try:
        _control("get_server_list", env, timeout_s=5.0)
        _control("quit", env, timeout_s=60.0)
    except (subprocess.TimeoutExpired, OSError):
        pass


def control_log_tail(directory: Path, lines: int = 20) -> str:
    """The daemon's own log: which clients connected, and any refusal."""
    path = directory / "log" / "control.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
