"""Sample the Serve processes' Python stacks while a benchmark runs, one profile per load.

    python3 benchmarks/gpu_evidence.py --part extras --out OUT/extras > OUT/log 2>&1 &
    python3 benchmarks/profile_loads.py --log OUT/log --driver-pid $! --apps extras --out OUT/profile

py-spy (a sampling profiler that reads another process's memory; it never stops the process with
`--nonblocking`) records every replica of the named apps, Serve's proxy, and the benchmark's own process
(its HTTP client) in segments. A segment starts when an app is deployed or a load ends, and is named after
the load that ends it: the benchmark logs `[t s] APP LOAD: ...` as each load finishes and starts the next
at once. It writes py-spy's collapsed stacks per segment and process (`<app>.<load>/<process>.txt`), and on
exit `summary.md`:
each process's busiest frames by share of samples, inclusive (the frame anywhere on the stack) and self
(the frame on top), which is where a slow load spends its host time.

Needs py-spy on PATH (or --py-spy) and ptrace rights over the processes (root in the device's container).
`--quiet-s` must outlast the benchmark's longest silence (a deploy: 60-70 s on the H200), or the
recorder ends before the first app is up. py-spy slows what it watches: at 50 Hz pdv served 3,324-3,753
tok/s against 4,860-5,833 unwatched (2026-11-28), so a profiled call's speeds are not results.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

DEPLOYED = re.compile(r"^\[\s*[\d.]+ s\] (\S+): deployed")
LOAD_DONE = re.compile(r"^\[\s*[\d.]+ s\] (\S+) (.+?): (?:concurrency|rate)=")
DONE = re.compile(r"^\[\s*[\d.]+ s\] done\b")  # gpu_evidence.py logs "done: ...", lanes_1gpu.py "done"
FRAME = re.compile(r"^(.*) \((.*?):\d+\)$")  # py-spy's "function (file.py:line)"


def serve_processes(app: str) -> list[tuple[str, int]]:
    """(role, pid) of every replica of the app (role: its deployment) and of Serve's proxy, from the
    process titles Ray sets; a deployment of several replicas appears once for each."""
    found = []
    for line in subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout.splitlines():
        pid, _, title = line.strip().partition(" ")
        m = re.match(rf"ray::ServeReplica:{re.escape(app)}:(\w+)", title)
        if m:
            found.append((m.group(1), int(pid)))
        elif title.startswith("ray::ProxyActor"):
            found.append(("proxy", int(pid)))
    return found


def serve_pids(app: str) -> dict[str, int]:
    """pid by name of the app's replicas and Serve's proxy: the role, or `role_pid` where the deployment
    has several replicas (lanes_1gpu.py runs two ingress replicas on a GPU), so that each is recorded."""
    found = serve_processes(app)
    replicas = Counter(role for role, _ in found)
    return {role if replicas[role] == 1 else f"{role}_{pid}": pid for role, pid in found}


class Segment:
    """One py-spy recorder per process, writing collapsed stacks until stopped."""

    def __init__(self, py_spy: str, pids: dict[str, int], folder: Path, rate_hz: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.started = time.monotonic()
        self.errors = {role: open(folder / f"{role}.err", "w") for role in pids}
        self.recorders = {
            role: subprocess.Popen([py_spy, "record", "--pid", str(pid), "--nonblocking", "--subprocesses",
                                    "--rate", str(rate_hz), "--format", "raw", "--output", str(folder / f"{role}.txt")],
                                   stdout=subprocess.DEVNULL, stderr=self.errors[role])
            for role, pid in pids.items()}

    def stop(self, name: str) -> Path:
        for p in self.recorders.values():
            p.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for p in self.recorders.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in self.errors.values():
            f.close()
        (self.folder / "seconds").write_text(f"{time.monotonic() - self.started:.2f}\n")
        target = self.folder.with_name(name)
        self.folder.rename(target)
        return target


def follow(path: Path, stop_after_s: float):
    """The log's lines as they are written; ends `stop_after_s` after the last line, or at `done:`."""
    while not path.exists():
        time.sleep(0.2)
    with path.open() as f:
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < stop_after_s:
            line = f.readline()
            if not line:
                time.sleep(0.05)
                continue
            quiet_since = time.monotonic()
            yield line.rstrip("\n")
            if DONE.match(line):
                return


def top_frames(raw: Path, limit: int) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """Samples, and the `limit` frames with the largest inclusive and self shares of them."""
    inclusive, own, total = Counter(), Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [short(f) for f in stack.split(";")[1:]]  # the first is the thread or process
        for f in set(frames):
            inclusive[f] += n
        if frames:
            own[frames[-1]] += n
    share = lambda c: [(f, round(100 * v / max(total, 1), 1)) for f, v in c.most_common(limit)]  # noqa: E731
    return total, share(inclusive), share(own)


def short(frame: str) -> str:
    m = FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    func, path = m.groups()
    return f"{func} ({'/'.join(Path(path).parts[-2:])})"


def summarize(out: Path, limit: int = 25) -> None:
    lines = ["# Host time by load and process (py-spy, --nonblocking, idle threads left out)", ""]
    for seg in sorted(p for p in out.iterdir() if p.is_dir()):
        seconds = (seg / "seconds").read_text().strip() if (seg / "seconds").exists() else "?"
        lines += [f"## {seg.name} ({seconds} s)", ""]
        for raw in sorted(seg.glob("*.txt")):
            total, inclusive, own = top_frames(raw, limit)
            lines += [f"### {raw.stem}: {total} samples", "", "| inclusive % | frame | | self % | frame |",
                      "|---|---|---|---|---|"]
            for i in range(max(len(inclusive), len(own))):
                a = inclusive[i] if i < len(inclusive) else ("", "")
                b = own[i] if i < len(own) else ("", "")
                lines.append(f"| {a[1]} | {a[0]} | | {b[1]} | {b[0]} |")
            lines.append("")
    (out / "summary.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", type=Path, required=True, help="the benchmark's output, as it is written")
    parser.add_argument("--apps", required=True, help="comma-separated app names to record")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--driver-pid", type=int, default=None, help="the benchmark's process (its client)")
    parser.add_argument("--py-spy", default="py-spy")
    parser.add_argument("--rate-hz", type=int, default=200)
    parser.add_argument("--quiet-s", type=float, default=120.0, help="stop when the log is quiet this long")
    args = parser.parse_args()
    apps = set(args.apps.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    segment, count = None, 0

    def start(app: str) -> Segment:
        nonlocal count
        pids = serve_pids(app)
        if args.driver_pid and os.path.exists(f"/proc/{args.driver_pid}"):
            pids["client"] = args.driver_pid
        count += 1
        return Segment(args.py_spy, pids, args.out / f"_recording{count}", args.rate_hz)

    for line in follow(args.log, args.quiet_s):
        deployed, done = DEPLOYED.match(line), LOAD_DONE.match(line)
        if deployed and deployed.group(1) in apps:
            segment = start(deployed.group(1))
        elif done and done.group(1) in apps and segment is not None:
            # A plain file name: the device's copy-back refuses names with other characters ("#2" of --repeats).
            app, load = done.group(1), re.sub(r"[^\w.-]", "_", done.group(2))
            segment.stop(f"{app}.{load}")
            segment = start(app)
        elif segment is not None and (done or DONE.match(line) or DEPLOYED.match(line)):
            segment.stop(f"_unnamed{count}")  # another app's lines: this app is gone
            segment = None
    if segment is not None:
        segment.stop(f"_unnamed{count}")
    summarize(args.out)


if __name__ == "__main__":
    main()
