"""The five modes on one GPU, served, under uniform load and under mixed traffic.

    python benchmarks/lanes_1gpu.py --part uniform --out OUT    # uniform load, then 7,000-token prompts
    python benchmarks/lanes_1gpu.py --part mixed --out OUT      # mixed traffic at two rates
    python benchmarks/lanes_1gpu.py --part uniform --mps --modes unified,pd,pdv,pdv2 --out OUT
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lanes_1gpu.py --part uniform --device cpu \\
        --shape small --out /tmp/lanes_1gpu                                      (CPU dry run)

Each part deploys every mode in turn on one GPU (the lane shares of benchmarks/lib/apps.py, which
are configs/pdv-1gpu.yaml's for pdv), all at `--max-model-len` (8,192 by default: the part checks
that every mode deploys there) and with `--ingress-replicas` OpenAI ingress replicas (2 on a GPU), drives it
through Serve's proxy with the load tester's streaming client (greedy, ignore_eos), and deletes it:

- uniform: prompts of 128 tokens, 128 out, 64 in flight, 256 requests (`--repeats N`: N times, each with
  prompts of its own, to see one deployment's spread); then 3 prompts of 7,000 tokens one after another
  (the max_model_len check).
- mixed: 10 % of prompts 3,000 tokens, the rest 128; 128 out. unified runs first, closed loop at 64
  in flight, and its completed requests/s is the capacity; then every mode gets the same Poisson
  arrivals at 50 % and at 80 % of it.

The model pair is benchmarks/constructed_pair.py's (a Llama-2-7B-shaped target and a
TinyLlama-shaped draft, random weights, greedy agreement `--agreement` by construction). For each
mode and load it reports completed, failed, timed out, tok/s, TTFT and TPOT p50/p95/p99, and the
decode stall: each short request's longest gap between two stream chunks, p99 over them. Every
submitted request is counted.

`--mps` runs everything as clients of NVIDIA's Multi-Process Service (benchmarks/lib/mps.py), so
the lanes' kernels share the GPU at once instead of taking turns in time slices. Mode `pdv2` is
pdv with two decode replicas (VARIANTS): one drafts while the verify lane scores the other's batch;
`pd512` and `pdv512` bound the prefill lane's forwards to 512 tokens.

`--trace-steps N` adds one more load to each mode, like its first c64 load (uniform) or its highest rate
(mixed), with prompts of its own and out of the results: a second into it, every decode replica's engine
records its next N steps with torch.profiler (lanes/engine/step_trace.py). The .md then ends with each
replica's ms a step by region of the step (drafting, the verify call's launch and wait, ...), and the
traces are under --out/traces/.

Writes lanes_1gpu_<part>.json (every point's summary and requests),
.md (the table) and .png (stall and TPOT by mode) under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from functools import partial
from pathlib import Path

import ray
import torch
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.apps import GPU_SHARES, PRESETS, app_args, engine_args, lane_reader, run_app  # noqa: E402
from benchmarks.lib.cluster import (git_commit, log, machine, replica_log_lines, serve_env,  # noqa: E402
                                    start_model_cluster, wait_for_device_memory)
from benchmarks.lib.goals import goal_rows  # noqa: E402
from benchmarks.lib.mps import control_log_tail, mps_daemon, server_pids  # noqa: E402
from benchmarks.lib.loads import MIXED, Load, exactly, mixed_requests, warmup_requests  # noqa: E402
from benchmarks.lib.pairs import PAIR_DIR, save_pair  # noqa: E402
from benchmarks.lib.results import plot_bars, point_document, row, rows_table, write_document  # noqa: E402
from benchmarks.lib.traces import decode_tracer, trace_rows, traced_load  # noqa: E402
from loadtest.arrivals import ClosedLoop, OpenLoop  # noqa: E402
from loadtest.workload import load_tokenizer, synthetic  # noqa: E402

MODES = ("unified", "spec", "nospec", "pd", "pdv")  # unified first: the mixed part's capacity is its
# Benchmark-only modes: a mode of configs/ with its lanes or engine set otherwise. pdv2: two decode replicas
# share the verify lane, so one drafts while the other's drafts are verified; the shares still add to 1.
# pd512, pdv512: the prefill lane's forwards hold at most 512 tokens (unified's chunk while decoding)
# instead of idle_prefill_tokens' 1,024, so that under MPS a decode step shares the GPU with no more
# prefill than unified puts beside its own decode steps.
# *_samepri: the prefill lane's kernels at MPS's normal priority, as the other lanes' (by default it runs below
# them, deployments/config.py DEFAULT_MPS_PRIORITY): what the priority buys under --mps.
# unified_thread, pd_thread, pdv_thread: the engine stepped on a thread of its replica (`engine_process:
# false`) instead of in a process of its own: what that costs. pdv_relay: pdv's engine sends its verify batches
# through its replica and Serve (`verify_channel: false`) instead of over the verify replica's channel. pdv_host:
# its drafts through the host (`shared_drafts: false`) instead of in a ring of device memory (lanes/device/shared_drafts.py).
# pd_lane: every prompt through pd's prefill lane (`local_prefill_max_tokens: 0`), as pd ran before prompts of
# at most one prefill chunk were prefilled in its decode lane (lanes/engine/split_prefill.py); pd512_lane the same
# with prefill forwards of 512 tokens.
# pd512_sm50, pd512_sm70, pdv_sm50, pdv512_sm50: the prefill lane's kernels capped under MPS to 50 % / 70 % of the
# SMs (`mps_sm_percent`), so that a running prefill forward never holds every SM a decode or verify step needs.
# pdv_split, pdv512_split, pdv512_split_sm50: pdv's short prompts (at most 512 tokens) prefilled where they decode,
# the target's KV by a verify replica and the draft's by the decode lane (`local_prefill_max_tokens`,
# deployments/channels/verify_prefill.py), as pd's are by its decode lane.
# *_ing1: one ingress replica instead of --ingress-replicas (2 on a GPU). One OpenAI ingress ran at 93-122 % of a
# core under unified's uniform load (top, 2026-11-28), so its event loop, not the engine, bounded how fast
# requests reached the engine: unified served 7,032-7,201 tok/s through one and 7,469-7,799 through two.
VARIANTS = {"pdv2": ("pdv", {"prefill_lane": {"num_gpus": 0.3}, "verify_lane": {"num_gpus": 0.54},
                             "decode_lane": {"num_gpus": 0.08, "num_replicas": 2}}),
            "pd512": ("pd", {"engine": {"idle_prefill_tokens": 512}}),
            "pd_lane": ("pd", {"local_prefill_max_tokens": 0}),
            "pd512_sm50": ("pd", {"engine": {"idle_prefill_tokens": 512}, "prefill_lane": {"mps_sm_percent": 50}}),
            "pd512_sm70": ("pd", {"engine": {"idle_prefill_tokens": 512}, "prefill_lane": {"mps_sm_percent": 70}}),
            "pdv_sm50": ("pdv", {"prefill_lane": {"mps_sm_percent": 50}}),
            "pdv512_sm50": ("pdv", {"engine": {"idle_prefill_tokens": 512}, "prefill_lane": {"mps_sm_percent": 50}}),
            "pd512_lane": ("pd", {"engine": {"idle_prefill_tokens": 512}, "local_prefill_max_tokens": 0}),
            "pdv512": ("pdv", {"engine": {"idle_prefill_tokens": 512}}),
            "pdv_split": ("pdv", {"local_prefill_max_tokens": 512}),
            "pdv512_split": ("pdv", {"engine": {"idle_prefill_tokens": 512}, "local_prefill_max_tokens": 512}),
            "pdv512_split_sm50": ("pdv", {"engine": {"idle_prefill_tokens": 512}, "local_prefill_max_tokens": 512,
                                          "prefill_lane": {"mps_sm_percent": 50}}),
            "pd_samepri": ("pd", {"prefill_lane": {"mps_priority": "normal"}}),
            "pdv_samepri": ("pdv", {"prefill_lane": {"mps_priority": "normal"}}),
            "pd512_samepri": ("pd", {"engine": {"idle_prefill_tokens": 512}, "prefill_lane": {"mps_priority": "normal"}}),
            "pdv512_samepri": ("pdv", {"engine": {"idle_prefill_tokens": 512},
                                       "prefill_lane": {"mps_priority": "normal"}}),
            "unified_thread": ("unified", {"engine_process": False}),
            "pd_thread": ("pd", {"engine_process": False}),
            "pdv_thread": ("pdv", {"engine_process": False}),
            "pdv_relay": ("pdv", {"verify_channel": False}),
            "pdv_host": ("pdv", {"shared_drafts": False}),
            "unified_ing1": ("unified", {"ingress": {"num_replicas": 1}}),
            "pd_ing1": ("pd", {"ingress": {"num_replicas": 1}}),
            "pdv_ing1": ("pdv", {"ingress": {"num_replicas": 1}})}
MPS_DIR = Path("/tmp/vpd-mps")  # short: the daemon's pipes are Unix sockets (108-byte paths)
SIZES = {  # by device: mixed traffic's lengths (MIXED), the max-len prompt, in flight, requests, mixed requests
    "cuda": dict(MIXED["cuda"], max_len_prompt=7000, in_flight=64, requests=256, mixed=240),
    "cpu": dict(MIXED["cpu"], max_len_prompt=200, in_flight=4, requests=12, mixed=16),
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
    parser.add_argument("--mps", action="store_true", help="run the lanes as clients of NVIDIA MPS")
    parser.add_argument("--ingress-replicas", type=int, default=None,
                        help="OpenAI ingress replicas of every mode: default 2 (cuda), 1 (cpu)")
    parser.add_argument("--serve-throughput-optimized", action="store_true",
                        help="start Ray with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (Serve's high-throughput settings)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="uniform: the c64 load this many times in each deployment, new prompts each time")
    parser.add_argument("--stream-every-step", action="store_true",
                        help="every mode streams each engine step's tokens (stream_interval_ms 0, no bound on "
                             "messages a second). By default a stream message waits at least 50 ms after the "
                             "one before, so no request's longest gap is under ~50 ms plus a step: that floor, "
                             "not the decode, is what the p99 stall reads wherever nothing stalls longer")
    parser.add_argument("--trace-steps", type=int, default=0,
                        help="after a mode's loads, one more like its c64 (uniform) or last-rate (mixed) load, with "
                             "prompts of its own and out of the results, in which every decode replica's engine "
                             "records this many steps with torch.profiler (benchmarks/lib/traces.py)")
    args = parser.parse_args(argv)
    args.shape = args.shape or ("tinyllama-7b" if args.device == "cuda" else "small")
    args.max_model_len = args.max_model_len or (8192 if args.device == "cuda" else 256)
    args.max_num_seqs = args.max_num_seqs or (160 if args.device == "cuda" else 8)
    args.ingress_replicas = args.ingress_replicas or (2 if args.device == "cuda" else 1)
    args.modes = args.modes.split(",")
    return args


def engine(args: argparse.Namespace) -> dict:
    return engine_args(args.max_model_len, args.max_num_seqs)


def requests_of(args: argparse.Namespace, tokenizer_dir: Path) -> dict[str, list]:
    size = SIZES[args.device]
    tokenizer = load_tokenizer(tokenizer_dir)
    # Seeds 0, 100, 200, ...: a repeat's prompts share no prefix with an earlier one's (the prefix cache is on).
    uniform = [synthetic(tokenizer, size["requests"], 100 * k, exactly(size["prompt"]), exactly(size["output"]))
               for k in range(args.repeats)]
    longest = synthetic(tokenizer, 3, 3, exactly(size["max_len_prompt"]), exactly(size["output"] // 2))
    return {"uniform": uniform, "max_len": longest,
            "warmup": warmup_requests(tokenizer, args.max_num_seqs, 7, exactly(size["prompt"]), 2, size["long"]),
            "mixed": mixed_requests(tokenizer, size["mixed"], 1, args.device),
            # The traced load's own prompts (seed 900 and up: none shared with the loads above); uniform: twice
            # as many, so that the load runs on well past the trace's start (traces.START_AFTER_S).
            "traced": (synthetic(tokenizer, 2 * size["requests"], 900, exactly(size["prompt"]), exactly(size["output"]))
                       if args.part == "uniform" else mixed_requests(tokenizer, size["mixed"], 901, args.device))}


def loads_of(args: argparse.Namespace, requests: dict, capacity_rps: float | None) -> list[Load]:
    loads = base_loads(args, requests, capacity_rps)
    if not args.trace_steps:
        return loads
    # Uniform: like the first c64 load (not the max-len check after it); mixed: like the highest rate.
    like = loads[1] if args.part == "uniform" else loads[-1]
    return loads + [traced_load(like, requests["traced"])]


def base_loads(args: argparse.Namespace, requests: dict, capacity_rps: float | None) -> list[Load]:
    """The warm-up, then the part's measured loads."""
    size = SIZES[args.device]
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


def mode_config(mode: str, args: argparse.Namespace, pair, preset: dict) -> tuple[str, dict]:
    """(the configs/ mode it runs, its app args): a variant's lanes and engine set as VARIANTS says."""
    base, overrides = VARIANTS.get(mode, (mode, {}))
    config = app_args(base, pair.target, pair.draft, dtype=preset["dtype"], engine=engine(args),
                      lane_num_cpus=preset["lane_num_cpus"], one_gpu=args.device == "cuda")
    # The ingress is stateless: two replicas keep one busy event loop from bounding the fastest mode (VARIANTS).
    config["ingress"]["num_replicas"] = args.ingress_replicas
    if args.stream_every_step:
        config.update(stream_interval_ms=0, max_stream_messages_per_s=None)
    for key, value in overrides.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return base, config


def verify_calls(app: str, calls: dict[str, dict], run) -> None:
    """After each of a pdv app's points: how many verify calls came over channels, and how many of those
    with their drafts in a ring of device memory (`shared_drafts`), summed over the verify replicas."""
    load = run.points[-1][0].name
    try:
        stats = serve.get_deployment_handle("VerifyLane", app_name=app).broadcast("stats").results(timeout_s=30)
    except Exception as exc:  # a diagnostic: never let it end the run
        calls[load] = {"error": f"{type(exc).__name__}: {exc}"}
        return
    calls[load] = {key: sum(s[key] for s in stats) for key in ("channel_calls", "ring_calls")}
    log(f"  verify calls so far: {calls[load]}")


def markdown(rows: list[dict], measured: list[dict], context: dict, traces: list[dict]) -> str:
    """Every point's row, the goals read from the `measured` ones, and the traces' rows."""
    machine_of = context["machine"]
    where = machine_of.get("gpu") or machine_of.get("cpu_model")
    goals = goal_rows(measured, lambda mode: VARIANTS.get(mode, (mode, {}))[0])
    lines = [f"# lanes_1gpu {context['part']}", "", f"`{context['command']}` on {where}, commit "
             f"{context['commit']}; pair {context['pair']}; capacity {context.get('capacity_rps')} "
             "requests/s", "", rows_table(rows), "## Goals against unified in this call (issue 28)", "",
             rows_table(goals) if goals else "(no mode with a goal next to unified)\n"]
    if traces:
        lines += ["## Decode replicas' steps under torch.profiler (ms a step; the traced load is no result)", "",
                  rows_table(traces, labels=3)]
    return "\n".join(lines)


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
    pair = save_pair(args.shape, args.agreement, PAIR_DIR, dtype=preset["dtype"], device=args.device,
                     reload_check="structure" if args.device == "cuda" else "full")
    requests = requests_of(args, pair.target)
    context = {"part": args.part, "command": "python benchmarks/lanes_1gpu.py " + " ".join(argv),
               "machine": machine(), "commit": git_commit(), "engine": engine(args),
               "lane_shares": GPU_SHARES, "variants": VARIANTS, "pair": {"shape": args.shape, "agreement": args.agreement},
               "serve_throughput_optimized": args.serve_throughput_optimized}
    port = start_model_cluster({**mps_env, **serve_env(args.serve_throughput_optimized)})
    if args.mps:
        context["mps"] = {"pipe_directory": mps_env["CUDA_MPS_PIPE_DIRECTORY"], "server_pids": server_pids(mps_env)}
        log(f"MPS: {context['mps']}")
    free_bytes = torch.cuda.mem_get_info()[0] if args.device == "cuda" else 0
    rows, measured, docs, capacity_rps = [], [], [], None
    name_of = f"lanes_1gpu_{args.part}"
    try:
        for i, mode in enumerate(args.modes):
            share_s = (deadline_s - time.monotonic()) / (len(args.modes) - i)
            name = f"{mode}-{args.part}"
            base, config = mode_config(mode, args, pair, preset)
            traces: dict[str, list[dict]] = {}
            calls: dict[str, dict] = {}  # pdv: how its verify calls came, after each point
            run = run_app(name, config, port, loads_of(args, requests, capacity_rps), time.monotonic() + share_s,
                          deploy_timeout_s=preset["deploy_timeout_s"], request_timeout_s=preset["request_timeout_s"],
                          seed=0, lanes_of=lane_reader(name, base) if base in ("unified", "pd", "pdv") else None,
                          # Behind several ingress replicas the server's totals are one replica's: acceptance
                          # from the responses' own counters (a 3-request point read -53 from the totals).
                          request_counters=True,
                          on_point=partial(verify_calls, name, calls) if base == "pdv" else lambda run: None,
                          sampler=decode_tracer(name, args.out / "traces", args.trace_steps, traces)
                          if args.trace_steps else None)
            docs.append({"mode": mode, "status": run.status, "error": run.error, "deploy_s": run.deploy_s,
                         "skipped": run.skipped, "lanes": run.lanes, "traces": traces, "verify_calls": calls,
                         "points": [point_document(load, point) for load, point in run.points]})
            for load, point in run.points:
                rows.append(row(point, mode=mode, load=load.name))
                if load.measured:  # not the warm-up, nor a traced load
                    measured.append(rows[-1])
            closed = next((p for load, p in run.points if load.name.startswith("mixed c")), None)
            if args.part == "mixed" and capacity_rps is None and closed is not None:
                capacity_rps = closed.summary.request_throughput_rps
                context["capacity_rps"] = round(capacity_rps, 3)
                log(f"capacity on mixed traffic ({mode}): {capacity_rps:.2f} requests/s")
            write_document(args.out, name_of, {"context": context, "rows": rows, "apps": docs},
                           markdown(rows, measured, context, trace_rows(docs)))
            if args.device == "cuda":
                wait_for_device_memory(free_bytes)
    finally:
        memory = replica_log_lines(("budget", "CUDA graphs of", "Error", "error", "failed", "recomput", "MPS:"))
        (args.out / f"{name_of}_memory.txt").write_text(memory)
        serve.shutdown()
        ray.shutdown()
    plot_bars(measured, args.out / f"{name_of}.png", ("stall_ms p99", "tpot_ms p99"), x="mode", series="load")


if __name__ == "__main__":
    main()
