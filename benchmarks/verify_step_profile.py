"""Where a verify step's time goes, kernel by kernel: the 7B verify step of gpu_check.py's table (4 drafts,
context 512) under torch.profiler, in whichever tree is on PYTHONPATH. Run it in the tree and in a
checkout of the slot-pool code to see which kernels paging made slower (issue 31, 2 (d)):

    PYTHONPATH=$PWD python3 benchmarks/verify_step_profile.py --out OUT/paged
    (cd results/tmp/slot_ref && PYTHONPATH=$PWD python3 ../../../benchmarks/verify_step_profile.py --out OUT/slots)

For each of CUDA graphs on (as served) and off (every kernel launched on its own): wall time a step, the
GPU's busy time a step (the union of kernel intervals), and each kernel's device time a step. With graphs
on, the profiler may see a graph's kernels or only its launch, depending on the CUDA version; graphs off
always shows them. The window holds gpu_check's whole `verify_step_ms`, so its set-up (one `normal_` over
the pool, torch's `distribution_elementwise` kernel) is spread over the 11 steps too, the same in both
trees. Writes verify_step_profile.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch

import benchmarks.gpu_check as gpu_check  # the tree on PYTHONPATH, not this file's

STEPS = 10


# lanes/engine/step_trace.py has the same function; this script runs against trees on PYTHONPATH that may predate it.
def busy_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def profile(batch: int, graphs: bool) -> dict:
    config = gpu_check.EngineConfig(max_model_len=gpu_check.CONTEXT + 8, max_num_seqs=64, prefill_chunk_tokens=64,
                                    idle_prefill_tokens=64, cuda_graphs=graphs)
    with torch.device("cuda"):
        model = gpu_check.build_random_model(gpu_check.LLAMA2_7B, dtype="bfloat16", device="cuda").model
    lane = gpu_check.VerifyLane(gpu_check.build_runner(model, config))
    gpu_check.verify_step_ms(lane, batch, 4)  # warm: graphs captured, kernels compiled
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        ms = gpu_check.verify_step_ms(lane, batch, 4)  # one warm call, then 10 timed (gpu_check.median_ms)
        wall_s = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    steps = STEPS + 1
    per_kernel = collections.Counter()
    for e in kernels:
        per_kernel[e.name[:90]] += e.time_range.elapsed_us() / steps
    del lane, model
    torch.cuda.empty_cache()
    return {"batch": batch, "cuda_graphs": graphs, "step_ms_median": round(ms, 3),
            "wall_ms_per_step": round(1e3 * wall_s / steps, 3),
            "gpu_busy_ms_per_step": round(busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3 / steps, 3),
            "kernels_seen": len(kernels),
            "kernel_us_per_step": {k: round(v, 1) for k, v in per_kernel.most_common(25)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [profile(args.batch, graphs) for graphs in (True, False)]
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "kernel_us_per_step"}), flush=True)
        for name, us in list(row["kernel_us_per_step"].items())[:12]:
            print(f"  {us:9.1f} us  {name}")
    (out / "verify_step_profile.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
