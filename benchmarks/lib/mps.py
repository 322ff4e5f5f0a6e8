"""NVIDIA's Multi-Process Service for lanes that share one GPU as separate processes: without it the driver
time-slices the GPU between them; under it their kernels run side by side. Only the control daemon is
started (the card's settings stay as found), and told to quit when the run ends.

    with mps_daemon(Path("/tmp/mps")) as env:   # before the first CUDA call of this process
        start_model_cluster(env)                 # replicas inherit the pipe directory
"""

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
    """Start the MPS control daemon with its pipes and logs under `directory`, export the variables that
    make this process and its children its clients, and yield them (for Ray's runtime_env too)."""
    if shutil.which(CONTROL) is None:
        raise MPSUnavailable(f"{CONTROL} is not on PATH")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(directory / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(directory / "log")}
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    started = _start(env)
    deadline_s = time.monotonic() + STALE_WAIT_S
    while started.returncode != 0 and time.monotonic() < deadline_s:
        # An earlier run's daemon that outlived its quit (it waits for its clients to exit; a `-d` meanwhile
        # exits 1 with nothing on stderr): ask it again and wait for it to go.
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            _control("get_server_list", env, timeout_s=5.0)
            _control("quit", env, timeout_s=60.0)
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
        with contextlib.suppress(subprocess.TimeoutExpired):  # past it, the daemon goes with the machine
            _control("quit", env, timeout_s=60.0)  # waits for its clients: Ray's replicas may still be exiting


def _start(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([CONTROL, "-d"], env={**os.environ, **env}, capture_output=True, text=True)


def control_log_tail(directory: Path, lines: int = 20) -> str:
    """The daemon's own log: which clients connected, and any refusal."""
    path = directory / "log" / "control.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
