"""The five modes on one GPU, served, under uniform load and under mixed traffic (issue 28).

    python benchmarks/lanes_1gpu.py --part uniform --out OUT    # uniform load, then 7,000-token prompts
    python benchmarks/lanes_1gpu.py --part mixed --out OUT      # mixed traffic at two rates
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lanes_1gpu.py --part uniform --device cpu \\
        --shape small --out /tmp/lanes_1gpu                                      (CPU dry run)

Each part deploys every mode in turn on one GPU (the lane shares of benchmarks/gpu_modes.py, which
are configs/pdv-1gpu.yaml's for pdv), all at `--max-model-len` (8,192 by default: the part checks
that every mode deploys there), drives it through Serve's proxy with the load tester's streaming
client (greedy, ignore_eos), and deletes it:

- uniform: prompts of 128 tokens, 128 out, 64 in flight, 256 requests; then 3 prompts of 7,000
  tokens one after another (the max_model_len check).
- mixed: 10 % of prompts 3,000 tokens, the rest 128; 128 out. unified runs first, closed loop at 64
  in flight, and its completed requests/s is the capacity; then every mode gets the same Poisson
  arrivals at 50 % and at 80 % of it.

The model pair is benchmarks/constructed_pair.py's (a Llama-2-7B-shaped target and a
TinyLlama-shaped draft, random weights, greedy agreement `--agreement` by construction). For each
mode and load it reports completed, failed, timed out, tok/s, TTFT and TPOT p50/p95/p99, and the
decode stall: each short request's longest gap between two stream chunks, p99 over them. Every
submitted request is counted. Writes lanes_1gpu_<part>.json (every point's summary and requests),
.md (the table) and .png (stall and TPOT by mode) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import ray
import torch
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks import gpu_modes  # noqa: E402
from benchmarks.gpu_modes import Load, log, run_app, save_pair, wait_for_device_memory  # noqa: E402
from benchmarks.lane_timelines import lane_activity, timelines  # noqa: E402
from benchmarks.serving import git_commit, machine, start_cluster  # noqa: E402
from loadtest.arrivals import ClosedLoop, OpenLoop  # noqa: E402
from loadtest.report import Point  # noqa: E402
from loadtest.workload import LogNormal, load_tokenizer, mix_long_prompts, synthetic  # noqa: E402

MODES = ("unified", "spec", "nospec", "pd", "pdv")  # unified first: the mixed part's capacity is its
SIZES = {  # by device: (prompt, output, long prompt, max-len prompt, in flight, requests, mixed requests)
    "cuda": dict(prompt=128, output=128, long=3000, max_len_prompt=7000, in_flight=64, requests=256, mixed=240),
    "cpu": dict(prompt=16, output=8, long=96, max_len_prompt=200, in_flight=4, requests=12, mixed=16),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("uniform", "mixed"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", choices=("small", "tinyllama-7b"), default=None)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--agreement", type=float, default=0.8)
    parser.add_argument("--max-model-len", type=int, default=None, help="default 8192 (cuda), 256 (cpu)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default 160 (cuda), 8 (cpu)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.8],
                        help="mixed: Poisson rates as shares of unified's capacity")
    parser.add_argument("--budget-s", type=float, default=560.0)
    args = parser.parse_args(argv)
    args.shape = args.shape or ("tinyllama-7b" if args.device == "cuda" else "small")
    args.max_model_len = args.max_model_len or (8192 if args.device == "cuda" else 256)
    args.max_num_seqs = args.max_num_seqs or (160 if args.device == "cuda" else 8)
    args.modes = args.modes.split(",")
    return args


def harness_args(args: argparse.Namespace) -> argparse.Namespace:
    """gpu_modes' settings (engine, lane shares, timeouts) for this run."""
    return gpu_modes.parse_args(["--device", args.device, "--shape", args.shape, "--out", str(args.out),
                                 "--max-model-len", str(args.max_model_len),
                                 "--max-num-seqs", str(args.max_num_seqs)])


def requests_of(args: argparse.Namespace, tokenizer_dir: Path) -> dict[str, list]:
    size = SIZES[args.device]
    tokenizer = load_tokenizer(tokenizer_dir)
    fixed = lambda n: LogNormal(n, 0.0, n, n)  # noqa: E731 - exactly n tokens
    uniform = synthetic(tokenizer, size["requests"], 0, fixed(size["prompt"]), fixed(size["output"]))
    warmup = synthetic(tokenizer, args.max_num_seqs, 7, fixed(size["prompt"]), LogNormal(24, 0.6, 4, 64))
    mixed = mix_long_prompts(synthetic(tokenizer, size["mixed"], 1, fixed(size["prompt"]), fixed(size["output"])),
                             0.1, size["long"], tokenizer, 2)
    longest = synthetic(tokenizer, 3, 3, fixed(size["max_len_prompt"]), fixed(size["output"] // 2))
    return {"uniform": uniform, "warmup": mix_long_prompts(warmup, 2 / len(warmup), size["long"], tokenizer, 8),
            "mixed": mixed, "max_len": longest}


def loads_of(mode: str, args: argparse.Namespace, requests: dict, capacity_rps: float | None) -> list[Load]:
    size = SIZES[args.device]
    loads = [Load("warmup", requests["warmup"], OpenLoop(float("inf")), measured=False)]
    if args.part == "uniform":
        return loads + [Load(f"uniform c{size['in_flight']}", requests["uniform"], ClosedLoop(size["in_flight"])),
                        Load(f"{size['max_len_prompt']}-token prompts", requests["max_len"], ClosedLoop(1))]
    if capacity_rps is not None:
        return loads + [Load(f"mixed {share:.0%}", requests["mixed"], OpenLoop(share * capacity_rps))
                        for share in args.rates]
    # The first mode: its capacity on this traffic first, then the same rates off it.
    closed = f"mixed c{size['in_flight']}"
    return loads + [Load(closed, requests["mixed"], ClosedLoop(size["in_flight"]))] + [
        Load(f"mixed {share:.0%}", requests["mixed"], rate_of=closed, factor=share) for share in args.rates]


def decode_stall_ms(point: Point, quantile: float = 99) -> float | None:
    """p`quantile` over completed short requests of each one's longest gap between two stream chunks."""
    gaps = [max(r.itl_ms) for r in point.result.records
            if r.kind == "normal" and r.status == "completed" and r.itl_ms]
    return float(np.percentile(gaps, quantile)) if gaps else None


def row(mode: str, load: Load, point: Point) -> dict:
    s = point.summary
    lat = s.latency_ms
    spec = s.spec_decode
    return {"mode": mode, "load": load.name, "arrivals": point.result.arrivals.label,
            "submitted": s.submitted, "completed": s.completed, "failed": s.failed, "timed_out": s.timed_out,
            "tok_s": round(s.output_token_throughput_tps, 1),
            **{f"{m} {q}": _round(getattr(lat[m], q)) for m in ("ttft_ms", "tpot_ms") for q in ("p50", "p95", "p99")},
            "stall_ms p99": _round(decode_stall_ms(point)),
            "acceptance": _round(spec.acceptance_rate if spec else None, 3),
            "errors": sorted({r.error for r in point.result.records if r.error})[:3]}


def _round(value, digits: int = 1):
    return None if value is None else round(value, digits)


def markdown(rows: list[dict], context: dict) -> str:
    columns = [c for c in rows[0] if c != "errors"] if rows else []
    machine_of = context["machine"]
    where = machine_of.get("gpu") or machine_of.get("cpu_model") if isinstance(machine_of, dict) else machine_of
    lines = [f"# lanes_1gpu {context['part']}", "", f"`{context['command']}` on {where}, commit "
             f"{context['commit']}; pair {context['pair']}; capacity {context.get('capacity_rps')} requests/s",
             "", "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if r[c] is None else str(r[c]) for c in columns) + " |" for r in rows]
    failures = {f"{r['mode']} {r['load']}": r["errors"] for r in rows if r["errors"]}
    if failures:
        lines += ["", "Errors seen by clients:", "```", json.dumps(failures, indent=1), "```"]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    measured = [r for r in rows if r["load"] != "warmup"]
    loads = list(dict.fromkeys(r["load"] for r in measured))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, metric in zip(axes, ("stall_ms p99", "tpot_ms p99")):
        for i, load in enumerate(loads):
            points = [r for r in measured if r["load"] == load]
            ax.bar([j + i / (len(loads) + 1) for j in range(len(points))], [r[metric] or 0 for r in points],
                   width=1 / (len(loads) + 1), label=load)
            ax.set_xticks(range(len(points)), [r["mode"] for r in points])
        ax.set_ylabel(metric)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline_s = time.monotonic() + args.budget_s
    harness = harness_args(args)
    pair = save_pair(args.shape, args.agreement, harness.pair_dir, dtype=harness.dtype, device=args.device,
                     reload_check="structure" if args.device == "cuda" else "full")
    requests = requests_of(args, pair.target)
    context = {"part": args.part, "command": "python benchmarks/lanes_1gpu.py " + " ".join(argv),
               "machine": machine(), "commit": git_commit(), "engine": gpu_modes.engine_args(harness),
               "lane_shares": gpu_modes.GPU_SHARES, "pair": {"shape": args.shape, "agreement": args.agreement}}
    os.environ["RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT"] = "1"  # a replica that fails is not loaded 3 times
    port = start_cluster({"TRITON_INTERPRET": "0", "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1"})
    free_bytes = torch.cuda.mem_get_info()[0] if args.device == "cuda" else 0
    rows, docs, capacity_rps = [], [], None
    try:
        for i, mode in enumerate(args.modes):
            share_s = (deadline_s - time.monotonic()) / (len(args.modes) - i)
            name = f"{mode}-{args.part}"

            def lanes_of(start_s: float, end_s: float, name=name, mode=mode) -> dict:
                # Where the lane modes spend their time: each lane's busy share, the prefill path's waits.
                return lane_activity(timelines(name, mode, start_s), start_s, end_s + 0.01)

            run = run_app(name, gpu_modes.app_args(mode, pair, harness), port,
                          loads_of(mode, args, requests, capacity_rps), time.monotonic() + share_s,
                          deploy_timeout_s=harness.deploy_timeout_s, request_timeout_s=harness.request_timeout_s,
                          seed=0, lanes_of=lanes_of if mode in ("pd", "pdv") else None)
            docs.append({"mode": mode, "status": run.status, "error": run.error, "deploy_s": run.deploy_s,
                         "skipped": run.skipped, "lanes": run.lanes,
                         "points": [gpu_modes.point_document(load, point) for load, point in run.points]})
            rows += [row(mode, load, point) for load, point in run.points]
            closed = next((p for load, p in run.points if load.name.startswith("mixed c")), None)
            if args.part == "mixed" and capacity_rps is None and closed is not None:
                capacity_rps = closed.summary.request_throughput_rps
                context["capacity_rps"] = round(capacity_rps, 3)
                log(f"capacity on mixed traffic ({mode}): {capacity_rps:.2f} requests/s")
            _write(args.out, args.part, context, rows, docs)
            if args.device == "cuda":
                wait_for_device_memory(free_bytes)
    finally:
        (args.out / f"lanes_1gpu_{args.part}_memory.txt").write_text(memory_lines())
        serve.shutdown()
        ray.shutdown()
    _write(args.out, args.part, context, rows, docs)
    plot(rows, args.out / f"lanes_1gpu_{args.part}.png")
    log("done")


def memory_lines() -> str:
    """Each replica's memory plan and graph captures, refusals and logged errors, from its log."""
    try:
        logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    except Exception as exc:  # a private API: never let it end the run
        return f"(replica logs not found: {exc})"
    wanted = ("budget", "CUDA graphs of", "Error", "error", "failed", "recomput")
    lines = [f"{path.name}: {line.strip()}" for path in sorted(logs.glob("replica_*.log"))
             for line in path.read_text(errors="replace").splitlines() if any(w in line for w in wanted)]
    return "\n".join(lines[:400])


def _write(out: Path, part: str, context: dict, rows: list[dict], docs: list[dict]) -> None:
    (out / f"lanes_1gpu_{part}.json").write_text(json.dumps({"context": context, "rows": rows, "apps": docs}))
    (out / f"lanes_1gpu_{part}.md").write_text(markdown(rows, context))


if __name__ == "__main__":
    main()
