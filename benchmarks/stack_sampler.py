"""Every few seconds, the Python stacks of every Serve replica process on this machine, with py-spy.

    python benchmarks/stack_sampler.py --out OUT/stacks --every-s 15 &   # beside a benchmark; kill it after

For a hang that the logs cannot explain (a call between lanes unanswered for a minute): which thread of
which lane is where, at several moments. py-spy reads a process from outside (ptrace), so a replica
blocked in C (a CUDA call, a lock) is read as well as one in Python. One file a process a sample,
named by seconds since the start, the replica's name and pid.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from pathlib import Path


def replicas() -> dict[int, str]:
    """pid -> Ray's process title (ray::ServeReplica:<app>:<deployment>) of each Serve replica."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            title = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # it ended meanwhile
            continue
        if title.startswith("ray::ServeReplica"):
            found[int(proc.name)] = title.split()[0].removeprefix("ray::ServeReplica:")
    return found


def sample(out: Path, start_s: float, py_spy: str, timeout_s: float) -> int:
    """One dump of every replica; returns how many were read."""
    at_s = time.monotonic() - start_s
    read = 0
    for pid, name in replicas().items():
        try:
            done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=timeout_s)
            text = done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            text = f"py-spy dump did not finish in {timeout_s} s"
        safe = name.replace(":", "_").replace("/", "_")
        (out / f"{at_s:06.0f}s_{safe}_{pid}.txt").write_text(text)
        read += 1
    return read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--every-s", type=float, default=15.0)
    parser.add_argument("--timeout-s", type=float, default=10.0, help="per dump")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("stack_sampler: py-spy is not on PATH (pip install py-spy)")
    args.out.mkdir(parents=True, exist_ok=True)
    start_s = time.monotonic()
    while True:
        began_s = time.monotonic()
        sample(args.out, start_s, py_spy, args.timeout_s)
        time.sleep(max(0.0, args.every_s - (time.monotonic() - began_s)))


if __name__ == "__main__":
    main()
