"""What a fresh Python process pays, in CPU seconds, to import what a replica or engine process imports
(issue 29): every Serve replica and engine process of the test suite is such a process.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/import_cost.py [--runs 5]

Each row is the median, over `--runs` fresh interpreters, of the user + system CPU time a child spent
running `python -c "<imports>"` (resource.getrusage of the children), from interpreter start to exit.
"""

import argparse
import resource
import statistics
import subprocess
import sys

# (label, the imports). The rows after the floor (ray + serve + torch) add one layer each to it, so their
# differences from it are what that layer costs.
FLOOR = "import ray; from ray import serve; import torch"
ROWS = (
    ("an empty interpreter", "pass"),
    ("ray + ray.serve (every Ray worker)", "import ray; from ray import serve"),
    ("torch", "import torch"),
    ("ray + serve + torch: the floor of a process that runs a model", FLOOR),
    ("+ transformers' AutoConfig", f"{FLOOR}; from transformers import AutoConfig"),
    ("+ transformers' AutoTokenizer", f"{FLOOR}; from transformers import AutoTokenizer"),
    ("+ transformers' modeling (AttentionInterface)", f"{FLOOR}; from transformers import AttentionInterface"),
    ("the engine process (lanes.engine.process, deployments.factories)",
     "import lanes.engine.process, deployments.factories"),
    ("the ingress replica (deployments.api.ingress)", "import deployments.api.ingress"),
    ("a lane replica (its deployment's module, deployments.factories)",
     "import deployments.replicas.engine_replica, deployments.factories"),
    ("the controller replica (controller.actor)", "import controller.actor"),
)


def child_cpu_s(code: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print("| imports | CPU-s (median) | min | max |\n|---|---|---|---|")
    for label, code in ROWS:
        times = [child_cpu_s(code) for _ in range(args.runs)]
        print(f"| {label} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} |", flush=True)


if __name__ == "__main__":
    main()
