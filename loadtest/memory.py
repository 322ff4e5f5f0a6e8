"""Memory of every replica process over a run (soak runs: `python -m loadtest run --duration-s 1800
--memory-sample-s 10`).

Every `interval_s` it asks the app which processes serve it (GET /v1/lanes: the ingress, each lane
replica, and the process that steps each decode engine) and reads each one's resident set size
from /proc, so the load tester must run on the node that hosts the replicas (a one-node cluster, or
the head node of a CPU test). GPU memory per process comes from NVML where a GPU is present.
Processes are named by lane and pid, so a replica that Serve restarted shows up as a new series.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pandas as pd

MIB = 2**20


@dataclass
class MemorySamples:
    # t_s, process, rss_mib, gpu_mib, and device_used_mib: the whole GPU's use at that sample (the
    # same for each process sampled then), which also counts memory a dead process left mapped.
    rows: list[dict] = field(default_factory=list)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=["t_s", "process", "rss_mib", "gpu_mib", "device_used_mib"])


def processes(lanes: dict) -> dict[str, int]:
    """name -> pid of every process /v1/lanes names."""
    named = {f"ingress:{lanes['ingress_pid']}": lanes["ingress_pid"]} if lanes.get("ingress_pid") else {}
    for lane, report in lanes.get("lanes", {}).items():
        for replica in report.get("replicas", []):
            for key in ("replica_pid", "engine_pid"):
                pid = replica.get(key)
                if pid:
                    kind = "engine" if key == "engine_pid" and pid != replica.get("replica_pid") else lane
                    named[f"{kind}:{pid}"] = pid
    return named


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MIB
    except OSError:  # gone (restarted), or not on this node
        return None
    return None


def _gpus() -> list:
    """NVML's handle of every GPU of this node (none without NVML, a driver or a GPU: CPU runs record RSS only)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - no driver, no GPU
        return []


def gpu_mib_by_pid() -> dict[int, float]:
    """Device memory each process holds, over every GPU of this node (empty without NVML or a GPU)."""
    used: dict[int, float] = {}
    handles = _gpus()
    if not handles:
        return used
    import pynvml  # _gpus() imported it

    for handle in handles:
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            used[proc.pid] = used.get(proc.pid, 0.0) + (proc.usedGpuMemory or 0) / MIB
    return used


def device_used_mib() -> float | None:
    """Memory in use over every GPU of this node, whoever holds it (None without NVML or a GPU)."""
    handles = _gpus()
    if not handles:
        return None
    import pynvml

    return round(sum(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles) / MIB, 1)


async def sample_memory(base_url: str, interval_s: float, samples: MemorySamples, stop: asyncio.Event,
                        headers: dict | None = None) -> None:
    """Append a sample of every serving process every `interval_s` until `stop` is set."""
    origin = time.monotonic()
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        while not stop.is_set():
            try:
                lanes = (await http.get(f"{base_url.rstrip('/')}/v1/lanes")).json()
            except (httpx.HTTPError, ValueError):
                lanes = {}  # a lane being replaced: try again at the next sample
            gpu, device = gpu_mib_by_pid(), device_used_mib()
            t_s = time.monotonic() - origin
            for name, pid in processes(lanes).items():
                rss = rss_mib(pid)
                if rss is not None:
                    samples.rows.append({"t_s": round(t_s, 1), "process": name, "rss_mib": round(rss, 1),
                                         "gpu_mib": round(gpu[pid], 1) if pid in gpu else None,
                                         "device_used_mib": device})
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass


def growth(frame: pd.DataFrame, warmup_s: float) -> dict[str, dict]:
    """Per process: RSS at the first sample after `warmup_s`, at the last, the peak, and the growth."""
    out = {}
    for name, rows in frame.groupby("process"):
        after = rows[rows["t_s"] >= warmup_s]
        if len(after) < 2:
            continue
        first, last = float(after["rss_mib"].iloc[0]), float(after["rss_mib"].iloc[-1])
        out[name] = {"rss_after_warmup_mib": first, "rss_last_mib": last, "rss_peak_mib": float(after["rss_mib"].max()),
                     "growth_frac": round((last - first) / first, 4), "samples": len(after)}
    return out


def write_memory(directory: Path, samples: MemorySamples, warmup_s: float) -> dict:
    """memory.csv, memory.png and the per-process growth (returned, for result.json)."""
    frame = samples.frame()
    frame.to_csv(directory / "memory.csv", index=False)
    if frame.empty:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, rows in frame.groupby("process"):
        ax.plot(rows["t_s"] / 60, rows["rss_mib"], label=name)
    ax.axvline(warmup_s / 60, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("resident set size (MiB)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(directory / "memory.png", dpi=120)
    plt.close(fig)
    return growth(frame, warmup_s)
