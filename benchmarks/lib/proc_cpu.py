"""The cores each serving process uses over a load point, read from /proc through scripts/proc_cpu.py:
which hop of a stream is busy (one near 1.0 core is an event loop or a GIL that bounds the point)."""

import os
import time

from scripts.proc_cpu import read_process, role


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of `pid` so far (None: it is gone)."""
    read = read_process(str(pid))
    return None if read is None else read[0]


def serve_processes(app: str) -> dict[str, int]:
    """The process ids of `app`'s replicas and of Serve's proxies on this machine, by role
    (`Ingress`, `DecodeLane`, ..., `proxy`); a deployment's second replica `#2`, and so on."""
    found: dict[str, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        read = read_process(pid)
        name = _role(read[2], app) if read is not None else None
        if name is not None:
            same = sum(key.split("#")[0] == name for key in found)
            found[f"{name}#{same + 1}" if same else name] = int(pid)
    return found


def _role(title: str, app: str) -> str | None:
    """`title`'s deployment if it is a replica of `app` (Ray names workers by actor), "proxy" for Serve's
    proxy, else None."""
    if title.startswith(f"ray::ServeReplica:{app}:"):
        return role(title).removeprefix("replica ")
    return "proxy" if role(title) == "ProxyActor" else None


class CpuMeter:
    """Cores each of `pids` (name -> pid) used between `start()` and `stop()`."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids

    def start(self) -> "CpuMeter":
        self._start = {name: cpu_s(pid) for name, pid in self.pids.items()}
        self._start_s = time.monotonic()
        return self

    def stop(self) -> dict[str, float]:
        wall_s = time.monotonic() - self._start_s
        cores = {}
        for name, pid in self.pids.items():
            before, after = self._start.get(name), cpu_s(pid)
            if before is not None and after is not None and wall_s > 0:
                cores[name] = round((after - before) / wall_s, 2)
        return cores
