"""The five modes on one GPU, served, under uniform load and under mixed traffic; method: docs/lanes_one_gpu.md.

    python benchmarks/lanes_1gpu.py --part uniform --out OUT    # 128/128 tokens, 64 in flight; 7,000-token prompts
    python benchmarks/lanes_1gpu.py --part mixed --out OUT      # 10 % of prompts 3,000 tokens, at --rates of capacity
    python benchmarks/lanes_1gpu.py --part uniform --mps --modes unified,pdv,pdv_host --repeats 2 --out OUT
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lanes_1gpu.py --part uniform --device cpu \\
        --shape small --out /tmp/lanes_1gpu                                      (CPU dry run)

Each of --modes (a mode of configs/ or one of VARIANTS) is deployed in turn, loaded through Serve's proxy and
deleted; the mixed part's rates are shares of the first mode's capacity. Writes lanes_1gpu_<part>.json (every
point), .md (a row per mode and load, the goals against unified) and .png (stall and TPOT) under --out.
"""

import argparse
import contextlib
import sys
import time
from pathlib import Path

import ray
import torch
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.apps import (GPU_SHARES, PRESETS, app_args, engine_args, lane_reader, run_app,  # noqa: E402
                                 sized_args)
from benchmarks.lib.cluster import (git_commit, log, machine, replica_log_lines, serve_env,  # noqa: E402
                                    start_model_cluster, wait_for_device_memory)
from benchmarks.lib.goals import goal_rows  # noqa: E402
from benchmarks.lib.mps import control_log_tail, mps_daemon, server_pids  # noqa: E402
from benchmarks.lib.loads import MIXED, Load, exactly, mixed_requests, warmup_requests  # noqa: E402
from benchmarks.lib.pairs import save_pair  # noqa: E402
from benchmarks.lib.results import (plot_bars, point_document, row, rows_table, script_parser,  # noqa: E402
                                    write_document)
from loadtest.arrivals import ClosedLoop, OpenLoop  # noqa: E402
from loadtest.workload import load_tokenizer, synthetic  # noqa: E402

MODES = ("unified", "spec", "nospec", "pd", "pdv")  # unified first: the mixed part's capacity is its
# Benchmark-only modes: a mode of configs/ with its lanes or engine set otherwise (why each: docs/lanes_one_gpu.md).
# *512: the prefill lane's forwards hold at most 512 tokens (unified's chunk while decoding); *_sm50: its kernels
# capped to 50 % of the SMs under MPS; pd_lane: every prompt through pd's prefill lane; pdv512_split: pdv's short
# prompts prefilled where they decode; pdv_host: pdv's drafts through the host instead of a ring of device memory.
VARIANTS = {"pd512": ("pd", {"engine": {"idle_prefill_tokens": 512}}),
            "pd_lane": ("pd", {"local_prefill_max_tokens": 0}),
            "pd512_sm50": ("pd", {"engine": {"idle_prefill_tokens": 512}, "prefill_lane": {"mps_sm_percent": 50}}),
            "pdv512": ("pdv", {"engine": {"idle_prefill_tokens": 512}}),
            "pdv512_sm50": ("pdv", {"engine": {"idle_prefill_tokens": 512}, "prefill_lane": {"mps_sm_percent": 50}}),
            "pdv512_split": ("pdv", {"engine": {"idle_prefill_tokens": 512}, "local_prefill_max_tokens": 512}),
            "pdv_host": ("pdv", {"shared_drafts": False})}
MPS_DIR = Path("/tmp/vpd-mps")  # short: the daemon's pipes are Unix sockets (108-byte paths)
# By device; every key is also a flag (prompt and output lengths are MIXED's). ingress_replicas: in every mode.
SIZES = {
    "cuda": dict(max_len_prompt=7000, in_flight=64, uniform_requests=256, mixed_requests=240, max_model_len=8192,
                 max_num_seqs=160, ingress_replicas=2),
    "cpu": dict(max_len_prompt=200, in_flight=4, uniform_requests=12, mixed_requests=16, max_model_len=256,
                max_num_seqs=8, ingress_replicas=1),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = script_parser(__doc__, budget_s=560.0, pair=True)  # and --device, --out, the pair's flags
    parser.add_argument("--part", choices=("uniform", "mixed"), required=True)
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {MODES} and {tuple(VARIANTS)}")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.8],
                        help="mixed: Poisson rates as shares of the first mode's capacity")
    parser.add_argument("--mps", action="store_true", help="run the lanes as clients of NVIDIA MPS")
    parser.add_argument("--serve-throughput-optimized", action="store_true",
                        help="start Ray with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (Serve's high-throughput settings)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="uniform: the c64 load this many times in each deployment, new prompts each time")
    parser.add_argument("--stream-every-step", action="store_true",
                        help="every mode streams each engine step's tokens (stream_interval_ms 0, no bound on "
                             "messages a second), so that the p99 stall is the decode's, not a stream interval's")
    args = sized_args(parser, SIZES, argv)
    args.modes = args.modes.split(",")
    return args


def requests_of(args: argparse.Namespace, tokenizer_dir: Path) -> dict[str, list]:
    size, prompt, output = args.sizes, exactly(MIXED[args.device]["prompt"]), MIXED[args.device]["output"]
    tokenizer = load_tokenizer(tokenizer_dir)
    # Seeds 0, 100, 200, ...: a repeat's prompts share no prefix with an earlier one's (the prefix cache is on).
    uniform = [synthetic(tokenizer, size["uniform_requests"], 100 * k, prompt, exactly(output))
               for k in range(args.repeats)]
    return {"uniform": uniform,
            "max_len": synthetic(tokenizer, 3, 3, exactly(size["max_len_prompt"]), exactly(output // 2)),
            "warmup": warmup_requests(tokenizer, size["max_num_seqs"], 7, prompt, 2, MIXED[args.device]["long"]),
            "mixed": mixed_requests(tokenizer, size["mixed_requests"], 1, args.device)}


def loads_of(args: argparse.Namespace, requests: dict, capacity_rps: float | None) -> list[Load]:
    """The warm-up, then the part's measured loads."""
    size = args.sizes
    loads = [Load("warmup", requests["warmup"], OpenLoop(float("inf")), measured=False)]
    if args.part == "uniform":
        name = f"uniform c{size['in_flight']}"
        return loads + [Load(name if k == 0 else f"{name} #{k + 1}", batch, ClosedLoop(size["in_flight"]))
                        for k, batch in enumerate(requests["uniform"])] + [
                        Load(f"{size['max_len_prompt']}-token prompts", requests["max_len"], ClosedLoop(1))]
    if capacity_rps is not None:
        return loads + [Load(f"mixed {share:.0%}", requests["mixed"], OpenLoop(share * capacity_rps))
                        for share in args.rates]
    # The first mode: its capacity on this traffic first, then the same rates off it.
    closed = f"mixed c{size['in_flight']}"
    return loads + [Load(closed, requests["mixed"], ClosedLoop(size["in_flight"]))] + [
        Load(f"mixed {share:.0%}", requests["mixed"], rate_of=closed, factor=share) for share in args.rates]


def mode_config(mode: str, args: argparse.Namespace, pair) -> tuple[str, dict]:
    """(the configs/ mode it runs, its app args): a variant's lanes and engine set as VARIANTS says."""
    base, overrides = VARIANTS.get(mode, (mode, {}))
    engine = engine_args(args.sizes["max_model_len"], args.sizes["max_num_seqs"])
    config = app_args(base, pair.target, pair.draft, dtype=args.dtype, engine=engine,
                      lane_num_cpus=PRESETS[args.device]["lane_num_cpus"], one_gpu=args.device == "cuda")
    # The ingress is stateless: two replicas keep one busy event loop from bounding the fastest mode.
    config["ingress"]["num_replicas"] = args.sizes["ingress_replicas"]
    if args.stream_every_step:
        config.update(stream_interval_ms=0, max_stream_messages_per_s=None)
    for key, value in overrides.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return base, config


def markdown(rows: list[dict], context: dict) -> str:
    """Every point's row, then the goals (goal_rows reads the measured loads only)."""
    where = context["machine"].get("gpu") or context["machine"].get("cpu_model")
    goals = goal_rows(rows, lambda mode: VARIANTS.get(mode, (mode, {}))[0])
    return "\n".join([f"# lanes_1gpu {context['part']}", "", f"`{context['command']}` on {where}, commit "
                      f"{context['commit']}; pair {context['pair']}; capacity {context.get('capacity_rps')} "
                      "requests/s", "", rows_table(rows), "## Goals against unified in this call", "",
                      rows_table(goals) if goals else "(no mode with a goal next to unified)\n"])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with mps_daemon(MPS_DIR) if args.mps else contextlib.nullcontext({}) as mps_env:
        try:
            measure(args, argv, mps_env)
        finally:
            if args.mps:
                (args.out / "mps_control.log").write_text(control_log_tail(MPS_DIR, 200))
    log("done")


def measure(args: argparse.Namespace, argv: list[str], mps_env: dict[str, str]) -> None:
    """Every mode of `args.modes` in turn on one cluster; the documents rewritten after each."""
    deadline_s = time.monotonic() + args.budget_s
    preset = PRESETS[args.device]
    pair = save_pair(args.shape, args.agreement, args.pair_dir, dtype=args.dtype, device=args.device, seed=args.seed,
                     reload_check="structure" if args.device == "cuda" else "full")
    requests = requests_of(args, pair.target)
    context = {"part": args.part, "command": "python benchmarks/lanes_1gpu.py " + " ".join(argv),
               "machine": machine(), "commit": git_commit(), "sizes": args.sizes, "lane_shares": GPU_SHARES,
               "engine": engine_args(args.sizes["max_model_len"], args.sizes["max_num_seqs"]), "variants": VARIANTS,
               "pair": {"shape": args.shape, "agreement": args.agreement},
               "serve_throughput_optimized": args.serve_throughput_optimized}
    port = start_model_cluster({**mps_env, **serve_env(args.serve_throughput_optimized)})
    if args.mps:
        context["mps"] = {"pipe_directory": mps_env["CUDA_MPS_PIPE_DIRECTORY"], "server_pids": server_pids(mps_env)}
        log(f"MPS: {context['mps']}")
    free_bytes = torch.cuda.mem_get_info()[0] if args.device == "cuda" else 0
    rows, docs, capacity_rps = [], [], None
    name_of = f"lanes_1gpu_{args.part}"
    try:
        for i, mode in enumerate(args.modes):
            share_s = (deadline_s - time.monotonic()) / (len(args.modes) - i)
            name = f"{mode}-{args.part}"
            base, config = mode_config(mode, args, pair)
            # request_counters: behind several ingress replicas the server's totals are one replica's.
            run = run_app(name, config, port, loads_of(args, requests, capacity_rps), time.monotonic() + share_s,
                          deploy_timeout_s=preset["deploy_timeout_s"], request_timeout_s=preset["request_timeout_s"],
                          seed=args.seed, request_counters=True,
                          lanes_of=lane_reader(name, base) if base in ("unified", "pd", "pdv") else None)
            docs.append({"mode": mode, "status": run.status, "error": run.error, "deploy_s": run.deploy_s,
                         "skipped": run.skipped, "lanes": run.lanes,
                         "points": [point_document(load, point) for load, point in run.points]})
            rows += [row(point, mode=mode, load=load.name) for load, point in run.points]
            closed = next((p for load, p in run.points if load.name.startswith("mixed c")), None)
            if args.part == "mixed" and capacity_rps is None and closed is not None:
                capacity_rps = closed.summary.request_throughput_rps
                context["capacity_rps"] = round(capacity_rps, 3)
                log(f"capacity on mixed traffic ({mode}): {capacity_rps:.2f} requests/s")
            write_document(args.out, name_of, {"context": context, "rows": rows, "apps": docs}, markdown(rows, context))
            wait_for_device_memory(free_bytes)
    finally:
        memory = replica_log_lines(("budget", "CUDA graphs of", "Error", "error", "failed", "recomput", "MPS:"))
        (args.out / f"{name_of}_memory.txt").write_text(memory)
        serve.shutdown()
        ray.shutdown()
    measured = [r for r in rows if r["load"] != "warmup"]
    plot_bars(measured, args.out / f"{name_of}.png", ("stall_ms p99", "tpot_ms p99"), x="mode", series="load")


if __name__ == "__main__":
    main()
