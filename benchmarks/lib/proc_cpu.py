"""The CPU time each serving process spends over a load point, read from /proc (Linux): which hop of a
stream (the engine, its replica, the ingress, Serve's proxy, the client) is busy.

A process near 1.0 core is a single event loop (or a GIL) that cannot go faster: the hop that bounds
the point. Ray names its workers by their actor (`ray::ServeReplica:<app>:<deployment>`,
`ray::ProxyActor`), which is how they are found here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CLOCK_TICKS_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of `pid` so far (None: it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_S  # utime, stime (stat's fields 14 and 15)


def serve_processes(app: str) -> dict[str, int]:
    """The process ids of `app`'s replicas and of Serve's proxies on this machine, by role
    (`Ingress`, `DecodeLane`, ..., `proxy`); several replicas of one deployment get `#1`, `#2`."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        role = _role(title, app)
        if role is not None:
            name, n = role, 1
            while name in found:
                n += 1
                name = f"{role}#{n}"
            found[name] = int(entry.name)
    return found


def _role(title: str, app: str) -> str | None:
    if title.startswith(f"ray::ServeReplica:{app}:"):
        # While it runs a call Ray appends the method: `...:DecodeLane.handle_request_streaming`.
        return title[len(f"ray::ServeReplica:{app}:"):].split()[0].split(".")[0]
    if title.startswith("ray::ProxyActor"):
        return "proxy"
    return None


class CpuMeter:
    """Cores each of `pids` (name -> pid) used between `start()` and `stop()`."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self._start: dict[str, float | None] = {}
        self._start_s = 0.0

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
