"""End to end on one GPU at 7B scale: the five modes under Poisson and closed-loop load (issue 7).

    python benchmarks/gpu_modes.py --shape tinyllama-7b --device cuda --agreements 0.8 --out OUT
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gpu_modes.py --shape small --device cpu \\
        --agreements 0.8 --out /tmp/gpu_modes                                        (CPU dry run)

For each agreement a, a constructed pair (benchmarks/constructed_pair.py, docs/constructed_pair.md):
a Llama-2-7B-shaped target and a TinyLlama-shaped draft whose greedy next tokens agree on a
share a of the 32000-token vocabulary, so greedy acceptance per drafted token is a by design.

1. The pair is saved as two HF model directories (save_pretrained) with a word-level tokenizer
   ("t0" ... "t31999", split on spaces: a prompt of n words is n tokens; no special tokens, so
   requests end at max_tokens), then loaded back through `load_model`, the replicas' own path,
   and checked: each model still follows its map and the reloaded pair's greedy agreement is the
   designed one.
2. Each mode is deployed on the one GPU (lane fractions summing to 1), warmed up with a burst of
   max_num_seqs requests (CUDA graphs are captured per batch bucket on first use), then driven
   by the load tester, one load after another (greedy, ignore_eos):
     c1              closed loop, 1 in flight (single-stream speed)
     c64             closed loop, --mid-concurrency in flight
     rate_mid        Poisson at --mid-rate-factor x the first mode's completed requests/s at c64,
                     the same rate and arrival times for every mode
     rate_high       Poisson at --high-rate-factor x this mode's own rate at c64, so that the
                     requests in flight pass 128 whatever the mode's speed
     rate_mid+long   rate_mid's requests and arrival times with --long-share of the prompts
                     --long-prompt-len tokens long (modes in --long-modes)
   and deleted before the next mode is deployed. A mode that fails is recorded, the rest go on.
3. Every point's summary (every submitted request completed, failed or timed out; TTFT, TPOT,
   ITL, E2E p50/p95/p99; requests in flight, time-weighted mean and peak; acceptance from the
   server's /v1/spec_decode/stats counters) and every request are written out, rewritten after
   each point so that a run cut short still leaves what it measured.

The run keeps to --budget-s: each mode gets an equal share of the time left, a load whose
estimated time no longer fits is skipped (and recorded as skipped), and request timeouts never
reach past the budget. Timestamps go to stdout.

Writes, under --out, per agreement (at most 4 files, what a device call can bring back):
    gpu_modes_a<agreement>.json   context, pair check, memory plan, each mode's status, every
                                  point's summary and requests (without inter-token gaps)
    gpu_modes_a<agreement>.md     goals of issue 7, acceptance, one table per load, a column a mode
    gpu_modes_a<agreement>_cdf.png, _load.png   latency CDFs at rate_mid; throughput and p95
                                  latencies against requests in flight (if matplotlib is installed)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import ray
import torch
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.constructed_pair import shape_configs  # noqa: E402
from benchmarks.lane_timelines import prefill_path_table  # noqa: E402
from benchmarks.lib.apps import PRESETS, AppRun, app_args, engine_args, lane_reader, run_app  # noqa: E402
from benchmarks.lib.cluster import (ALL_MODES, STARTED_S, git_commit, load_average, log, machine,  # noqa: E402
                                    start_model_cluster, wait_for_device_memory)
from benchmarks.lib.loads import Load, warmup_requests  # noqa: E402
from benchmarks.lib.pairs import PAIR_DIR, SavedPair, parameter_count, save_pair  # noqa: E402
from benchmarks.lib.results import point_document, ratio, rounded, write_document  # noqa: E402
from deployments.factories import PREFILL_BATCH_MAX  # noqa: E402
from lanes.engine.core import EngineConfig  # noqa: E402
from lanes.model.loader import resolve_dtype  # noqa: E402
from loadtest.arrivals import ClosedLoop, OpenLoop  # noqa: E402
from loadtest.report import (Point, comparison_table, markdown_table,  # noqa: E402
                             plot_latency_cdfs, plot_load_curves)
from loadtest.workload import LogNormal, WorkloadRequest, load_tokenizer, mix_long_prompts, synthetic  # noqa: E402

LANE_MODES = ("unified", "pd", "pdv")  # the modes with lanes; "best lane mode" is the best of these
TABLE_ROWS = ["offered_rate_rps", "submitted", "completed", "failed", "timed_out", "wall_s",
              "mean_in_flight", "max_in_flight", "request_throughput_rps",
              "output_token_throughput_tps", "ttft_ms p50", "ttft_ms p95", "ttft_ms p99",
              "tpot_ms p50", "tpot_ms p95", "tpot_ms p99", "itl_ms p50", "itl_ms p99",
              "e2e_ms p50", "e2e_ms p95", "e2e_ms p99", "acceptance_rate",
              "mean_acceptance_length", "accepted_at_position_1"]


# ---- sizes ------------------------------------------------------------------------------------

def kv_bytes_per_token(config: dict, dtype: str) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * resolve_dtype(dtype).itemsize


def memory_plan(args: argparse.Namespace) -> dict:
    """The longest context whose pools fit the hungriest mode on this GPU.

    pd and pdv hold each model twice (the prefill lane's copy, and the decode or verify lane's)
    and, per model, a pool of max_num_seqs + 1 slots plus the prefill lane's PREFILL_BATCH_MAX + 1;
    every slot holds max_model_len plus the engine's slack. `reserve_gib` is left for CUDA
    contexts, graphs, activations and the driver.
    """
    target_config, draft_config = shape_configs(args.shape)
    itemsize = resolve_dtype(args.dtype).itemsize
    weight_bytes = (parameter_count(target_config) + parameter_count(draft_config)) * itemsize
    token_bytes = kv_bytes_per_token(target_config, args.dtype) + kv_bytes_per_token(draft_config, args.dtype)
    slots = args.max_num_seqs + 1 + PREFILL_BATCH_MAX + 1
    slack = EngineConfig(**{**mode_engine_args(args), "max_model_len": 2}).slot_capacity_tokens - 2
    gpu_bytes = torch.cuda.mem_get_info()[1]
    free_bytes = gpu_bytes - args.reserve_gib * 2**30 - 2 * weight_bytes
    max_model_len = int((free_bytes // (slots * token_bytes) - slack) // 64 * 64)
    return {"gpu_gib": round(gpu_bytes / 2**30, 1), "weights_gib_per_copy": round(weight_bytes / 2**30, 2),
            "kv_bytes_per_token": token_bytes, "slots": slots, "reserve_gib": args.reserve_gib,
            "max_model_len": max_model_len,
            "pools_gib": round(slots * (max_model_len + slack) * token_bytes / 2**30, 1)}



def mode_engine_args(args: argparse.Namespace) -> dict:
    return engine_args(args.max_model_len, args.max_num_seqs, args.draft_len, args.gpu_memory_utilization)


def mode_app_args(mode: str, pair: SavedPair, args: argparse.Namespace) -> dict:
    """configs/<mode>.yaml's args on the saved pair, the benchmark's engine and one GPU's lanes."""
    return app_args(mode, pair.target, pair.draft, dtype=args.dtype, engine=mode_engine_args(args),
                    lane_num_cpus=args.lane_num_cpus, one_gpu=args.device == "cuda", controller=args.controller)


# ---- loads ------------------------------------------------------------------------------------

def workloads(args: argparse.Namespace, tokenizer_dir: Path) -> dict[str, list[WorkloadRequest]]:
    """The request lists, drawn once and sent to every mode. `long` is `normal`'s first
    rate_requests with a share of long prompts; `warmup_long` is `warmup` with two (the modes that
    get long prompts meet them first in the warm-up; plain spec would prefill them padded into one
    forward with every other waiting prompt, so it gets none)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    prompts = LogNormal(args.prompt_len_median, 0.6, args.min_prompt_len, args.max_prompt_len)
    outputs = LogNormal(args.output_len_median, 0.3, args.min_output_len, args.max_output_len)
    longest = max(args.single_requests, args.mid_requests, args.rate_requests, args.high_requests)
    normal = synthetic(tokenizer, longest, args.seed, prompts, outputs)
    return {"normal": normal, "warmup": warmup_requests(tokenizer, args.max_num_seqs, args.seed + 7, prompts),
            "warmup_long": warmup_requests(tokenizer, args.max_num_seqs, args.seed + 7, prompts, 2,
                                           args.long_prompt_len),
            "long": mix_long_prompts(normal[:args.rate_requests], args.long_share, args.long_prompt_len,
                                     tokenizer, args.seed + 1)}


def mode_loads(mode: str, requests: dict[str, list[WorkloadRequest]], args: argparse.Namespace,
               mid_rate_rps: float | None) -> list[Load]:
    """A mode's loads, in order (module docstring); rate_mid is fixed once the first mode set it."""
    mid = f"c{args.mid_concurrency}"
    normal = requests["normal"]
    rate_mid = ({"arrivals": OpenLoop(mid_rate_rps)} if mid_rate_rps
                else {"rate_of": mid, "factor": args.mid_rate_factor})
    warmup = requests["warmup_long" if mode in args.long_modes else "warmup"]
    loads = [Load("warmup", warmup, OpenLoop(float("inf")), measured=False),
             Load("c1", normal[:args.single_requests], ClosedLoop(1)),
             Load(mid, normal[:args.mid_requests], ClosedLoop(args.mid_concurrency)),
             Load("rate_mid", normal[:args.rate_requests], **rate_mid),
             Load("rate_high", normal[:args.high_requests], rate_of=mid, factor=args.high_rate_factor)]
    if mode in args.long_modes:
        loads.append(Load("rate_mid+long", requests["long"], **rate_mid))
    return loads



# ---- results ----------------------------------------------------------------------------------

@dataclass
class AgreementResults:
    pair: SavedPair
    runs: dict[str, AppRun] = field(default_factory=dict)
    mid_rate_rps: float | None = None



def measured_points(results: AgreementResults, load_name: str) -> dict[str, Point]:
    return {mode: point for mode, run in results.runs.items()
            for load, point in run.points if load.name == load_name}


def goals(results: AgreementResults, args: argparse.Namespace) -> dict:
    """Issue 7's goals, read off the points (None where a point is missing)."""
    def tps(points: dict[str, Point], mode: str) -> float | None:
        return points[mode].summary.output_token_throughput_tps if mode in points else None

    def decode_rate(points: dict[str, Point], mode: str) -> float | None:
        tpot_ms = points[mode].summary.latency_ms["tpot_ms"].p50 if mode in points else None
        return 1000 / tpot_ms if tpot_ms else None

    single, mid = measured_points(results, "c1"), measured_points(results, f"c{args.mid_concurrency}")
    # A mode that lost requests does not win: its throughput counts only what it finished.
    lost = {m: p.summary.failed + p.summary.timed_out for m, p in mid.items()}
    lane_tps = {m: tps(mid, m) for m in LANE_MODES if m in mid and not lost[m]}
    best = max(lane_tps, key=lane_tps.get) if lane_tps else None
    base, long = measured_points(results, "rate_mid"), measured_points(results, "rate_mid+long")
    long_tpot = {}
    for mode in long:
        without = base[mode].summary.latency_ms["tpot_ms"].p95 if mode in base else None
        with_all = long[mode].summary.latency_ms["tpot_ms"].p95
        with_normal = long[mode].summary.latency_ms_by_kind.get("normal", {}).get("tpot_ms")
        long_tpot[mode] = {"p95_tpot_ms_without": without, "p95_tpot_ms_with_all": with_all,
                           "p95_tpot_ms_with_normal_prompts": with_normal.p95 if with_normal else None,
                           "ratio_all": ratio(with_all, without),
                           "ratio_normal_prompts": ratio(with_normal.p95 if with_normal else None, without)}
    peaks = {m: max(p.summary.max_in_flight for _, p in run.points) for m, run in results.runs.items()
             if run.points}
    served = {m: p.summary.spec_decode for m, p in mid.items() if p.summary.spec_decode
              and p.summary.spec_decode.acceptance_rate is not None}
    return rounded({
        "acceptance_at_mid_load": {
            "designed_per_token": results.pair.agreement,
            "accepted_at_position_1": {m: spec.acceptance_rate_per_pos[0] for m, spec in served.items()},
            "acceptance_rate": {m: spec.acceptance_rate for m, spec in served.items()},
            "mean_acceptance_length": {m: spec.mean_acceptance_length for m, spec in served.items()}},
        # Decode rate (1 / median TPOT), not throughput: c1's few requests are dominated by TTFT,
        # which the first request of a mode inflates (first captures).
        "single_stream": {"spec_over_nospec": ratio(decode_rate(single, "spec"), decode_rate(single, "nospec")),
                          "by_mode_over_nospec": {m: ratio(decode_rate(single, m), decode_rate(single, "nospec"))
                                                  for m in single},
                          "measure": "1000 / tpot_ms p50 at c1",
                          "goal": ">= 2 at acceptance ~0.75"},
        f"at_{args.mid_concurrency}_in_flight": {
            "best_lane_mode": best, "best_over_nospec": ratio(tps(mid, best), tps(mid, "nospec")),
            "best_over_spec": ratio(tps(mid, best), tps(mid, "spec")),
            "by_mode_tok_s": {m: tps(mid, m) for m in mid}, "failed_or_timed_out_by_mode": lost,
            "goal": "best >= nospec and >= 1.3 x spec, among modes that finished every request"},
        "long_prompts_p95_tpot": {"by_mode": long_tpot, "best_lane_mode": best, "goal": "ratio <= 1.2"},
        "peak_in_flight_by_mode": peaks,
        "every_request_accounted": all(
            p.summary.completed + p.summary.failed + p.summary.timed_out == p.summary.submitted
            == len(p.result.records) for run in results.runs.values() for _, p in run.points),
    })


def write_results(out: Path, context: dict, results: AgreementResults, args: argparse.Namespace,
                  final: bool) -> Path:
    """Rewrite the agreement's JSON and Markdown (and, at the end, its plots)."""
    stem = out / f"gpu_modes_a{results.pair.agreement:g}"
    document = {**context, "elapsed_s": round(time.monotonic() - STARTED_S, 1),
                "pair": {"agreement": results.pair.agreement, "target": str(results.pair.target),
                         "draft": str(results.pair.draft), "save_s": round(results.pair.save_s, 1),
                         "reload_check": results.pair.check},
                "mid_rate_rps": results.mid_rate_rps,
                "modes": {m: {"status": r.status, "error": r.error, "deploy_s": r.deploy_s,
                              "skipped": r.skipped, "lanes": r.lanes} for m, r in results.runs.items()},
                "goals": goals(results, args),
                "points": [point_document(load, point) for run in results.runs.values()
                           for load, point in run.points]}
    write_document(out, stem.name, document, markdown(document, results, args))
    if final:
        write_plots(stem, results, args)
    return stem


def load_table(points: dict[str, Point], with_kinds: bool) -> pd.DataFrame:
    """TABLE_ROWS for one load, a column per mode (`with_kinds`: and the normal prompts' p95 TPOT)."""
    table = comparison_table(list(points.values()))
    table.columns = list(points)
    table.loc["offered_rate_rps"] = [getattr(p.result.arrivals, "rate_rps", None) for p in points.values()]
    table.loc["accepted_at_position_1"] = [
        p.summary.spec_decode.acceptance_rate_per_pos[0]
        if p.summary.spec_decode and p.summary.spec_decode.acceptance_rate_per_pos else None
        for p in points.values()]
    rows = list(TABLE_ROWS)
    if with_kinds:
        rows.append("tpot_ms p95 (normal prompts)")
        table.loc[rows[-1]] = [p.summary.latency_ms_by_kind["normal"]["tpot_ms"].p95
                               for p in points.values()]
    return table.loc[rows]


def markdown(document: dict, results: AgreementResults, args: argparse.Namespace) -> str:
    m, pair, plan = document["machine"], document["pair"], document["memory_plan"]
    check = pair["reload_check"]
    reloaded = (f"only the stored heads checked (--reload-check structure): {json.dumps(check)}"
                if "target" in check else
                f"map fidelity {check['map_fidelity']['target']:.3f} / {check['map_fidelity']['draft']:.3f}, "
                f"greedy agreement on random contexts {check['predicted_per_token_acceptance']['greedy']:.3f} "
                f"(designed {check['designed_greedy_agreement']:.3f}), untied heads {check['untied_lm_head']}: "
                f"{'ok' if check['ok'] else 'NOT OK'}")
    lines = [f"# Modes end to end on one GPU, agreement {pair['agreement']:g}", "",
             f"- Machine: {m['gpu'] or 'no GPU'}, {m['cpu_cores']} CPU cores; torch {m['torch']}, "
             f"Ray {m['ray']}; commit {document['commit']}; {document['elapsed_s']:.0f} s so far.",
             f"- Command: `{document['command']}`",
             f"- Pair: constructed ({args.shape}: target {document['parameters']['target']:,} and draft "
             f"{document['parameters']['draft']:,} parameters, {args.dtype}), greedy next tokens agreeing "
             f"on a share {pair['agreement']:g} of the vocabulary by design. Reloaded from disk: {reloaded}.",
             "- Acceptance below is the server's counters over each point (greedy requests on "
             "random-token prompts): `acceptance_rate` is vLLM's (accepted / drafted, a draft stops "
             "at its first rejection), `accepted_at_position_1` is the share of drafts whose first "
             "token was accepted, the per-token acceptance.",
             f"- Engine: {json.dumps(document['engine'])}; memory plan {json.dumps(plan)}.",
             f"- Workload: {json.dumps(document['workload'])}; rate_mid "
             f"{results.mid_rate_rps or 'n/a'} requests/s for every mode.", ""]
    lines += ["## Goals (issue 7)", "", "```", json.dumps(document["goals"], indent=1), "```", ""]
    lines += ["## Modes", "", "| mode | status | deploy s | skipped | error |", "|---|---|---|---|---|"]
    lines += [f"| {mode} | {r['status']} | {r['deploy_s'] or 0:.0f} | {r['skipped'] or ''} | "
              f"{(r['error'] or '')[:300]} |" for mode, r in document["modes"].items()]
    lines += prefill_path_table([(mode, load, lanes["prefill_path"]) for mode, r in document["modes"].items()
                                 for load, lanes in r["lanes"].items() if "prefill_path" in lanes])
    for name in dict.fromkeys(load.name for run in results.runs.values() for load, _ in run.points):
        points = measured_points(results, name)
        lines += ["", f"## {name}", "", markdown_table(load_table(points, name.endswith("+long")))]
        errors = {r.error for p in points.values() for r in p.result.records if r.error}
        lines += [f"Errors: {sorted(errors)[:5]}", ""] if errors else []
    return "\n".join(lines)


def write_plots(stem: Path, results: AgreementResults, args: argparse.Namespace) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        log("no matplotlib: plots skipped (the JSON has what they show)")
        return
    at_mid_rate = list(measured_points(results, "rate_mid").values())
    if at_mid_rate:
        plot_latency_cdfs(at_mid_rate, stem.with_name(stem.name + "_cdf.png"))
    closed = [p for name in ("c1", f"c{args.mid_concurrency}") for p in measured_points(results, name).values()]
    if closed:
        plot_load_curves(closed, stem.with_name(stem.name + "_load.png"))


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("small", "tinyllama-7b"), default="tinyllama-7b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--agreements", type=float, nargs="+", default=[0.8])
    parser.add_argument("--modes", default=",".join(ALL_MODES), help="in this order; the first sets rate_mid")
    parser.add_argument("--long-modes", default="nospec," + ",".join(LANE_MODES),
                        help="modes that also get rate_mid+long")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pair-dir", type=Path, default=PAIR_DIR,
                        help="saved pairs; a finished save there is reused")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="engine.gpu_memory_utilization of every lane: the KV pools get this share of the GPU "
                        "(times the lane's num_gpus) less the weights; activations and CUDA graphs need the rest")
    parser.add_argument("--controller", action="store_true",
                        help="run the draft-length controller (controller/) in every mode that drafts")
    parser.add_argument("--draft-len", type=int, default=3,
                        help="L, tokens drafted per verify step (3: the best single-stream L at agreement 0.8)")
    parser.add_argument("--reserve-gib", type=float, default=12.0,
                        help="GPU memory left out of the pools (contexts, graphs, activations)")
    parser.add_argument("--long-share", type=float, default=0.1)
    parser.add_argument("--mid-rate-factor", type=float, default=0.75)
    parser.add_argument("--high-rate-factor", type=float, default=4.0)
    parser.add_argument("--mid-rate", type=float, default=None,
                        help="rate_mid in requests/s for every mode (default: from the first mode)")
    parser.add_argument("--reload-check", choices=("full", "structure"), default=None,
                        help="full: load the saved pair and measure its map and greedy agreement (default on "
                        "cpu); structure: only check the stored, untied LM heads (default on cuda, where "
                        "loading 16 GB costs budget; the served acceptance then checks the rest)")
    for key, value in PRESETS["cuda"].items():
        flag = "--" + key.replace("_", "-")
        parser.add_argument(flag, type=type(value), default=None, help=f"default {value} on cuda, "
                            f"{PRESETS['cpu'][key]} on cpu" + (" (0: as long as fits)" if key == "max_model_len" else ""))
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.reload_check = args.reload_check or ("structure" if args.device == "cuda" else "full")
    args.modes = args.modes.split(",")
    args.long_modes = args.long_modes.split(",")
    return args


def fit_lengths(args: argparse.Namespace) -> dict | None:
    """On the GPU, size max_model_len to its memory and the long prompts to max_model_len."""
    plan = memory_plan(args) if args.device == "cuda" else None
    if plan and not args.max_model_len:
        args.max_model_len = plan["max_model_len"]
    needed = args.max_prompt_len + args.max_output_len
    if args.max_model_len < needed:
        raise SystemExit(f"max_model_len {args.max_model_len} < {needed} (longest prompt + output) with "
                         f"max_num_seqs {args.max_num_seqs} on this GPU ({plan}): lower --max-num-seqs or "
                         "use a GPU with more memory")
    args.long_prompt_len = min(args.long_prompt_len, args.max_model_len - args.max_output_len)
    return plan


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline_s = STARTED_S + args.budget_s
    plan = fit_lengths(args)
    log(f"max_model_len {args.max_model_len}, long prompts {args.long_prompt_len} tokens; plan {plan}")
    pairs = [save_pair(args.shape, a, args.pair_dir, dtype=args.dtype, device=args.device, seed=args.seed,
                       reload_check=args.reload_check) for a in args.agreements]
    requests = workloads(args, pairs[0].target)
    target_config, draft_config = shape_configs(args.shape)
    context = {"command": "python benchmarks/gpu_modes.py " + " ".join(argv), "machine": machine(),
               "commit": git_commit(), "args": {k: str(v) for k, v in vars(args).items()},
               "shapes": {"target": target_config, "draft": draft_config},
               "parameters": {"target": parameter_count(target_config), "draft": parameter_count(draft_config)},
               "engine": mode_engine_args(args), "memory_plan": plan, "load_average_before": load_average(),
               "workload": {name: {"requests": len(reqs), "prompt_tokens": sum(r.prompt_len for r in reqs),
                                   "output_tokens": sum(r.output_len for r in reqs),
                                   "long_prompts": sum(r.kind == "long" for r in reqs)}
                            for name, reqs in requests.items()}}
    port = start_model_cluster()
    log(f"Ray and Serve up (port {port})")
    free_bytes = torch.cuda.mem_get_info()[0] if args.device == "cuda" else 0
    apps_left = len(pairs) * len(args.modes)
    mid_rate = args.mid_rate
    try:
        for pair in pairs:
            results = AgreementResults(pair, mid_rate_rps=mid_rate)
            for mode in args.modes:
                share_s = (deadline_s - time.monotonic()) / apps_left
                apps_left -= 1
                name = f"{mode}-a{pair.agreement:g}".replace(".", "_")
                log(f"{name}: deploying ({share_s:.0f} s for it)")

                def on_point(run: AppRun, mode=mode) -> None:
                    results.runs[mode] = run
                    write_results(args.out, context, results, args, final=False)

                run = run_app(name, mode_app_args(mode, pair, args), port,
                              mode_loads(mode, requests, args, results.mid_rate_rps),
                              time.monotonic() + share_s, deploy_timeout_s=args.deploy_timeout_s,
                              request_timeout_s=args.request_timeout_s, seed=args.seed, on_point=on_point,
                              lanes_of=lane_reader(name, mode) if mode in ("pd", "pdv") else None)
                results.runs[mode] = run
                rate_mid = next((p for load, p in run.points if load.name == "rate_mid"), None)
                if results.mid_rate_rps is None and rate_mid is not None:
                    results.mid_rate_rps = mid_rate = rate_mid.result.arrivals.rate_rps
                    log(f"rate_mid fixed at {mid_rate:.3f} requests/s for the modes after {mode}")
                write_results(args.out, context, results, args, final=False)
                if args.device == "cuda":
                    wait_for_device_memory(free_bytes)
            stem = write_results(args.out, context, results, args, final=True)
            log(f"wrote {stem}.json / .md; goals: {json.dumps(goals(results, args))}")
    finally:
        serve.shutdown()
        ray.shutdown()
    log("done")


if __name__ == "__main__":
    main()
