"""Where pdv requests wait before they decode, on this machine's CPU with the shipped pair.

Deploys pdv (two decode replicas, the test suite's small-CPU lane shares), sends bursts of 1, 8 and
32 greedy requests at once, and prints for each burst the split of the wait before decoding that
benchmarks/dual_gpu.py reports per rate (`prefill_path`, from the lanes' timelines). A probe of the
software path, not of speed: on two shared cores the lanes compete for the CPU.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/prefill_path_cpu.py
"""

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lane_timelines import lane_activity, timelines  # noqa: E402
from deployments.config import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from tests.serve_helpers import app_config, base_url, deploy, start_ray  # noqa: E402

BURSTS = (1, 8, 32)


async def _burst(n: int) -> list[int]:
    async def one(http: httpx.AsyncClient, i: int) -> int:
        body = {"model": "vpd-python", "prompt": f"def f{i}(x):\n    return " + "x + " * (10 + i % 20),
                "max_tokens": 24, "temperature": 0}
        return (await http.post(f"{base_url('pdv')}/completions", json=body)).status_code

    async with httpx.AsyncClient(timeout=300) as http:
        return await asyncio.gather(*(one(http, i) for i in range(n)))


def main() -> None:
    start_ray()
    config = app_config("pdv", DEFAULT_TARGET, DEFAULT_DRAFT)
    config["engine"]["max_num_seqs"] = 48
    deploy({"pdv": config})
    asyncio.run(_burst(4))  # warm-up
    for n in BURSTS:
        start_s = time.time()
        codes = asyncio.run(_burst(n))
        end_s = time.time()
        lanes = lane_activity(timelines("pdv", "pdv", start_s), start_s, end_s + 0.01)
        print(json.dumps({"requests": n, "http_status": sorted(set(codes)), "wall_s": round(end_s - start_s, 2),
                          "rows_per_verify": lanes.get("rows_per_verify"), "prefill_path": lanes.get("prefill_path")}),
              flush=True)
    serve.shutdown()


if __name__ == "__main__":
    main()
