"""What deployed apps cost the CPU while they serve nothing (issue 29): the tests' apps on the tiny pair, on a
cluster started as the tests start it, then every process's CPU share over a quiet window.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/idle_cpu.py --modes pdv,unified --window-s 30

Each app answers one greedy request first (its first step allocates and compiles), then the cluster is left
alone for `--settle-s` before the window. A process's share is its user + system CPU time over the window
(/proc/<pid>/stat), as a percentage of one core.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.proc_cpu import read_process  # noqa: E402


def cpu_by_process() -> dict[str, tuple[float, str]]:
    """pid -> (CPU seconds so far, command line) for every process readable now."""
    return {pid: (read[0], read[2]) for pid in filter(str.isdigit, os.listdir("/proc"))
            if (read := read_process(pid)) is not None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="pdv,unified", help="apps to deploy, each with the tests' config")
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=15.0)
    parser.add_argument("--top", type=int, default=25, help="processes listed, the busiest last")
    args = parser.parse_args(argv)

    from tests.serve_helpers import app_config, ray_cluster, stop_ray
    from tests.tiny_pair import save_tiny_pair

    with tempfile.TemporaryDirectory(prefix="vpd-idle-") as tmp:
        target, draft = save_tiny_pair(Path(tmp))
        ray_cluster()
        try:
            measure({mode: app_config(mode, target, draft) for mode in args.modes.split(",")}, args)
        finally:
            stop_ray()


def measure(apps: dict[str, dict], args: argparse.Namespace) -> None:
    from tests.serve_helpers import deploy, greedy_choice, wait_answering

    start = time.monotonic()
    deploy(apps)
    wait_answering(list(apps))
    print(f"deployed {list(apps)} in {time.monotonic() - start:.1f} s")
    for mode in apps:
        greedy_choice(mode, "def add(a, b):", 16)
    time.sleep(args.settle_s)
    before = cpu_by_process()
    time.sleep(args.window_s)
    after = cpu_by_process()
    shares = sorted(((after[pid][0] - before[pid][0]) / args.window_s, after[pid][1][:110])
                    for pid in after if pid in before)
    for share, cmd in shares[-args.top:]:
        print(f"{share * 100:6.1f} %  {cmd}")
    print(f"all processes: {sum(s for s, _ in shares) * 100:.1f} % of one core over {args.window_s:.0f} s")


if __name__ == "__main__":
    main()
