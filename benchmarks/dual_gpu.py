"""Lanes placed over the two GPUs of one host, against one GPU and against data parallelism.

Each placement (a file of configs/placements/) is deployed in turn in one Ray cluster: where every
replica runs (checked against what the file means), a warm-up, a Poisson rate sweep per workload with
the lanes' overlap, all within --budget-s. Method and results: docs/dual_gpu.md.

    python3 benchmarks/dual_gpu.py --out DIR                       # two-GPU host, under 9 minutes
    python3 benchmarks/dual_gpu.py --out DIR --placements d,b,c,f --workloads uniform,mixed \
        --rates 4,8,16,32 --sat-ttft-ms 1000 --budget-s 520     # goodput, one device call
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dual_gpu.py --shape small --device cpu \
        --budget-s 1300 --out DIR                                  # CPU dry run: every step, no GPUs
    .venv/bin/python benchmarks/dual_gpu.py --plot-only DIR        # plots from DIR/dual_gpu.json

Writes DIR/dual_gpu.json (everything, every request), dual_gpu.md (tables: goodput at p99 TPOT 15/20/30 ms),
dual_gpu.csv (a column per placement and rate) and, with matplotlib, dual_gpu_load_curve.png and dual_gpu_goodput.png.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # replicas inherit it: kernels compile for the GPU

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from ray import serve  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.constructed_pair import shape_configs  # noqa: E402
from benchmarks.lib.timelines import prefill_path_table, timelines  # noqa: E402
from benchmarks.lib.apps import PRESETS, AppRun, deploy_app, lane_reader, last_point, run_loads  # noqa: E402
from benchmarks.lib.cluster import (REPO, git_commit, gpu_inventory, log, machine, shm_gib,  # noqa: E402
                                    start_model_cluster, topology, wait_for_device_memory)
from benchmarks.lib.loads import MIXED, Load, mixed_requests, warmup_requests  # noqa: E402
from benchmarks.lib.pairs import PAIR_DIR, parameter_count, save_pair  # noqa: E402
from benchmarks.lib.results import (TPOT_SLOS_MS, TTFT_SLO_MS, goodput, plot_bars, pyplot, request_rows,  # noqa: E402
                                    row, rows_table, summary_from_dict, write_document)
from deployments.config import AppConfig  # noqa: E402
from loadtest.arrivals import OpenLoop  # noqa: E402
from loadtest.report import Point, comparison_table, plot_load_curves  # noqa: E402
from loadtest.runner import RunResult  # noqa: E402
from loadtest.summary import Summary  # noqa: E402
from loadtest.workload import LogNormal, WorkloadRequest, load_tokenizer, synthetic  # noqa: E402

NAME = "dual_gpu"
RESERVE_S = 20.0  # kept back from the budget for the last results
MIN_PLACEMENT_S = {"cuda": 75.0, "cpu": 60.0}  # less, and a placement cannot deploy, warm up and run two rates
DELETE_S = 10.0  # what removing an app takes, allowed for in every placement
WORKLOADS = ("uniform", "mixed")


@dataclass(frozen=True)
class PlacementSpec:
    key: str
    config: str  # file in configs/placements/
    title: str
    # Lanes of the replicas sharing each GPU (one tuple per GPU, sorted): what the config means.
    gpus: tuple[tuple[str, ...], ...]


PLACEMENTS = {p.key: p for p in (
    PlacementSpec("a", "a-unified-1gpu.yaml", "(a) unified, one GPU", (("engine",),)),
    PlacementSpec("a2", "a2-pdv-1gpu.yaml", "(a') pdv, one GPU", (("decode", "decode", "prefill", "verify"),)),
    PlacementSpec("b", "b-pdv-verify-apart.yaml", "(b) prefill + draft, verify apart",
                  (("decode", "decode", "prefill"), ("verify",))),
    PlacementSpec("c", "c-pdv-prefill-apart.yaml", "(c) prefill apart, draft + verify",
                  (("decode", "decode", "verify"), ("prefill",))),
    PlacementSpec("d", "d-unified-dp2.yaml", "(d) unified x2, data parallel", (("engine",), ("engine",))),
    PlacementSpec("f", "f-pd-prefill-apart.yaml", "(f) pd, prefill apart, draft + verify in one engine",
                  (("decode",), ("prefill",))),
)}


# ---- where replicas run ------------------------------------------------------------------------

def observed_gpus(reports: list[dict], inventory: list[dict]) -> dict:
    """Which GPU each replica got, grouped the way PlacementSpec.gpus states intent."""
    index = {g["uuid"]: g["index"] for g in inventory}
    replicas, groups = [], {}
    for r in reports:
        uuid = r["placement"]["gpu_uuid"]
        replicas.append({"lane": r["lane"], "replica": r["replica"], "gpu_uuid": uuid, "gpu_index": index.get(uuid),
                         "ray_gpu_ids": r["ray_gpu_ids"], "cuda_visible_devices": r["cuda_visible_devices"]})
        if uuid is not None:
            groups.setdefault(uuid, []).append(r["lane"])
    shared = sorted(tuple(sorted(lanes)) for lanes in groups.values())
    return {"replicas": replicas, "gpu_groups": [list(g) for g in shared]}


def as_intended(spec: PlacementSpec, observed: dict) -> bool | None:
    """True when the replicas share GPUs exactly as the config means; None without GPUs."""
    if not observed["gpu_groups"]:
        return None
    return [tuple(g) for g in observed["gpu_groups"]] == sorted(spec.gpus)


# ---- configs ---------------------------------------------------------------------------------

def placement_args(spec: PlacementSpec, target: str, draft: str, device: str) -> dict:
    """The `args:` of the placement's config with this run's pair; on the CPU, a dry-run version."""
    config = yaml.safe_load((REPO / "configs" / "placements" / spec.config).read_text())
    args = config["applications"][0]["args"]
    args["target"]["path"], args["draft"]["path"] = target, draft
    if device == "cpu":
        args = cpu_dry_run(args)
    AppConfig.model_validate(args)  # a config error names the field before anything starts
    return args


def cpu_dry_run(args: dict) -> dict:
    """The same graph (modes, replica counts) on CPU-sized engines: no GPUs, small pools, fp32."""
    args = json.loads(json.dumps(args))
    for lane in ("ingress", "prefill_lane", "decode_lane", "verify_lane"):
        if lane in args:
            args[lane] |= {"num_gpus": 0, "num_cpus": 0.1}
    args["engine"] |= {"max_model_len": 640, "max_num_seqs": 8, "prefill_chunk_tokens": 128}
    args["target"]["dtype"] = args["draft"]["dtype"] = "float32"
    return args


def replica_gpus(app_args: dict) -> list[tuple[str, float]]:
    """(lane, num_gpus) of every lane replica the config asks for, lanes named as replicas report them."""
    cfg = AppConfig.model_validate(app_args)
    names = {"prefill_lane": "prefill", "verify_lane": "verify",
             "decode_lane": "decode" if cfg.mode in ("pd", "pdv") else "engine"}
    return [(names[lane], getattr(cfg, lane).num_gpus) for lane in cfg.lanes
            for _ in range(getattr(cfg, lane).num_replicas or 1)]


def fit_lengths(args: argparse.Namespace, configs: dict[str, dict]) -> None:
    """Mixed traffic's long prompts need a longer context than the placement files give: raise it. Uniform
    prompts long enough to be refused would fail at every rate: cap them to the smallest context."""
    if "mixed" in args.workloads:
        needed = MIXED[args.device]["long"] + MIXED[args.device]["output"] + 64
        for key, config in configs.items():
            if config["engine"]["max_model_len"] < needed:
                log(f"{key}: max_model_len {config['engine']['max_model_len']} -> {needed} (mixed traffic)")
                config["engine"]["max_model_len"] = needed
                AppConfig.model_validate(config)
    context = min(AppConfig.model_validate(c).engine.max_model_len for c in configs.values())
    longest = context - args.max_output_len - 8
    if args.max_prompt_len > longest:
        log(f"max prompt {args.max_prompt_len} -> {longest} tokens (context {context}, outputs up to "
            f"{args.max_output_len})")
        args.max_prompt_len = longest


# ---- workloads ---------------------------------------------------------------------------------

def sweep_requests(args: argparse.Namespace, tokenizer, workload: str, rate: float) -> list[WorkloadRequest]:
    """About `window_s` seconds of requests at `rate`, the same for every placement (seeded by the
    rate). uniform: log-normal lengths (PRESETS); mixed: MIXED's traffic."""
    count, seed = max(8, round(rate * args.window_s)), args.seed + round(rate * 100)
    if workload == "mixed":
        return mixed_requests(tokenizer, count, seed, args.device)
    return synthetic(tokenizer, count, seed, prompt_lengths(args),
                     LogNormal(args.output_len_median, 0.3, args.min_output_len, args.max_output_len))


def prompt_lengths(args: argparse.Namespace) -> LogNormal:
    return LogNormal(args.prompt_len_median, 0.6, args.min_prompt_len, args.max_prompt_len)


# ---- one placement ----------------------------------------------------------------------------

@contextmanager
def timed(timings_s: dict, phase: str):
    start_s = time.monotonic()
    try:
        yield
    finally:
        timings_s[phase] = round(time.monotonic() - start_s, 1)


def run_placement(spec: PlacementSpec, app_args: dict, args: argparse.Namespace, tokenizer, port: int,
                  deadline_s: float, inventory: list[dict], on_point: Callable[[dict], None]) -> dict:
    """Deploy, check where replicas run, warm up, sweep each workload; the app is removed after.
    `on_point(result)` after every point: the placement's results so far."""
    mode, timings_s = app_args["mode"], {}
    result: dict = {"key": spec.key, "title": spec.title, "config": f"configs/placements/{spec.config}",
                    "app_args": app_args, "status": "running", "timings_s": timings_s, "sweep": []}
    run = AppRun(spec.key)

    def record(run: AppRun) -> None:
        result["sweep"] = sweep_points(run, args.sat_ttft_ms)
        on_point(result)

    with timed(timings_s, "deploy"):
        deployed = deploy_app(run, app_args, timeout_s=max(30.0, deadline_s - time.monotonic() - DELETE_S))
    if not deployed:
        return result | {"status": "failed", "error": run.error, "replica_logs": run.replica_logs}
    try:
        observed = observed_gpus(timelines(spec.key, mode, time.time()), inventory)
        result |= {"placement": observed, "as_intended": as_intended(spec, observed),
                   "asked_num_gpus": replica_gpus(app_args)}
        log(f"{spec.key}: GPUs {observed['gpu_groups'] or 'none (CPU)'}, as intended: {result['as_intended']}")
        sweeps_end_s = deadline_s - DELETE_S
        options = dict(request_timeout_s=args.request_timeout_s, seed=args.seed, request_counters=True,
                       on_point=record, lanes_of=lane_reader(spec.key, mode))
        with timed(timings_s, "warmup"):
            result["warmup"] = warm_up(run, port, app_args, args, tokenizer, sweeps_end_s, options)
        with timed(timings_s, "sweep"):
            for n, workload in enumerate(args.workloads):  # each workload an equal share of the time left
                share_s = (sweeps_end_s - time.monotonic()) / (len(args.workloads) - n)
                sweep(run, port, workload, args, tokenizer, time.monotonic() + share_s, options)
    except Exception as exc:  # noqa: BLE001 - recorded; the next placement still runs
        run.failed(f"{type(exc).__name__}: {exc}")
    finally:
        with timed(timings_s, "delete"):
            try:
                serve.delete(spec.key)
            except Exception as exc:  # noqa: BLE001
                log(f"{spec.key}: delete failed: {exc}")
    result |= {"status": run.status, "sweep": sweep_points(run, args.sat_ttft_ms), "skipped_loads": run.skipped}
    return result | ({"error": run.error, "replica_logs": run.replica_logs} if run.error else {})


def warm_up(run: AppRun, port: int, app_args: dict, args: argparse.Namespace, tokenizer, deadline_s: float,
            options: dict) -> dict:
    """A burst as large as the app's decode slots (every CUDA-graph batch bucket passed going down),
    with two long prompts when mixed traffic follows: a placement meets long prompts first here."""
    cfg, long_prompts = AppConfig.model_validate(app_args), 2 if "mixed" in args.workloads else 0
    slots = cfg.engine.max_num_seqs * (cfg.decode_lane.num_replicas or 1)
    requests = warmup_requests(tokenizer, slots, args.seed + 7, prompt_lengths(args), long_prompts,
                               MIXED[args.device]["long"])
    warm = Load("warmup", requests, OpenLoop(math.inf), measured=False)
    run_loads(run, port, [warm], deadline_s, **options)
    warmed = last_point(run, warm)
    return {"requests": len(requests), "completed": warmed.summary.completed if warmed else 0}


def sweep(run: AppRun, port: int, workload: str, args: argparse.Namespace, tokenizer, deadline_s: float,
          options: dict) -> None:
    """Poisson arrivals at each rate until one saturates or time runs out; after the first saturated
    rate, one rate between it and the last unsaturated one (the knee is where placements differ)."""
    rates, last_ok = list(args.rates), None
    while rates:
        rate = rates.pop(0)
        load = Load(f"{workload} {rate:g}/s", sweep_requests(args, tokenizer, workload, rate), OpenLoop(rate))
        run_loads(run, port, [load], deadline_s, **options)
        point = last_point(run, load)
        if point is None:  # no time left for it
            return
        if not saturated(point.summary, args.sat_ttft_ms):
            last_ok = rate
            continue
        between = round(math.sqrt(last_ok * rate), 2) if last_ok is not None else None
        rates = [between] if args.refine and between is not None and between not in args.rates + [rate] else []
        last_ok = None  # after the rate between, stop whatever it shows


def saturated(summary: Summary, sat_ttft_ms: float) -> bool:
    """A request failed or timed out, or p95 TTFT shows queueing."""
    ttft_p95 = summary.latency_ms["ttft_ms"].p95
    return summary.completed < summary.submitted or ttft_p95 is None or ttft_p95 > sat_ttft_ms


def sweep_points(run: AppRun, sat_ttft_ms: float) -> list[dict]:
    """The measured points as the results keep them, each with its row (counts, p99s, decode stall),
    by workload in run order, then by rate."""
    points = []
    for load, point in run.points:
        if load.measured:
            workload = load.name.split()[0]
            points.append({"workload": workload, "rate_rps": load.arrivals.rate_rps,
                           "summary": point.summary.to_dict(), "saturated": saturated(point.summary, sat_ttft_ms),
                           "lanes": run.lanes.get(load.name, {}),
                           "row": row(point, placement=run.name, workload=workload), "requests": request_rows(point)})
    workloads = list(dict.fromkeys(p["workload"] for p in points))
    return sorted(points, key=lambda p: (workloads.index(p["workload"]), p["rate_rps"]))


# ---- results ----------------------------------------------------------------------------------

def by_workload(placement: dict) -> dict[str, list[dict]]:
    """The placement's sweep points by workload, in run order (older results have only uniform)."""
    points: dict[str, list[dict]] = {}
    for p in placement.get("sweep", []):
        points.setdefault(p.get("workload", "uniform"), []).append(p)
    return points


def point_label(placement: dict, point: dict) -> str:
    """The placement's key, and the workload unless uniform."""
    workload = point.get("workload", "uniform")
    return placement["key"] + ("" if workload == "uniform" else f" {workload}")


def points_of(document: dict) -> list[Point]:
    """The sweep points as the load tester's Points (for its table and load curves), from the JSON."""
    return [Point(label=point_label(placement, p), summary=summary_from_dict(p["summary"]),
                  result=RunResult(base_url="", model="", arrivals=OpenLoop(p["rate_rps"]), records=[],
                                   warmup_records=[]))
            for placement in document["placements"] for p in placement.get("sweep", [])]


def goodput_table(document: dict) -> list[dict]:
    """Per placement and workload: goodput at each p99 TPOT bound (results.goodput: the most completed
    requests/s among the rates with every request completed, p99 TPOT within the bound and p99 TTFT
    within TTFT_SLO_MS), the p99 decode stall at that rate, and every request the sweep submitted."""
    rows = []
    for placement in document["placements"]:
        for workload, points in by_workload(placement).items():
            counts = {k: sum(p["summary"][k] for p in points) for k in ("submitted", "completed", "failed",
                                                                          "timed_out")}
            row = {"placement": placement["key"], "workload": workload, **counts}
            for bound in TPOT_SLOS_MS:
                best = goodput(points, bound) or {"summary": {"request_throughput_rps": None}, "row": {}}
                rps = best["summary"]["request_throughput_rps"]
                row[f"goodput rps, TPOT<={bound:g}"] = None if rps is None else round(rps, 2)
                row[f"stall ms p99, TPOT<={bound:g}"] = best.get("row", {}).get("stall_ms p99")  # none in older runs
            rows.append(row)
    return rows


def write_results(out: Path, document: dict, plots: bool = True) -> None:
    """dual_gpu.json, .md and .csv; with `plots`, the load curves and goodput bars where matplotlib is."""
    document["goodput"] = goodput_table(document)
    write_document(out, NAME, document, markdown(document))
    points = points_of(document)
    if points:
        comparison_table(points).to_csv(out / f"{NAME}.csv")
    if not plots:
        return
    if pyplot() is None:  # the GPU image may lack matplotlib
        print(f"plots skipped (no matplotlib); run --plot-only {out} where it is installed", flush=True)
        return
    if points:
        plot_load_curves(points, out / f"{NAME}_load_curve.png")
    bounds = tuple(f"goodput rps, TPOT<={bound:g}" for bound in TPOT_SLOS_MS)
    plot_bars(document["goodput"], out / f"{NAME}_goodput.png", bounds, x="placement", series="workload")


def markdown(document: dict) -> str:
    lines = header(document)
    lines += ["## Where each replica ran", "", rows_table([replicas_row(p) for p in document["placements"]])]
    for p in document["placements"]:
        for key, what in (("error", "failed"), ("reason", "skipped")):
            if p.get(key):
                lines += [f"{p['key']} {what}: `{p[key]}`", ""]
    lines += ["## Rate sweep", "",
              rows_table([sweep_row(pt) for p in document["placements"] for pt in p.get("sweep", [])]),
              "stall: p99 over short requests of each one's longest gap between stream chunks. acceptance: vLLM's "
              "acceptance rate over the responses' counters. busy: share of the window the verify lane ran forwards "
              "(pdv) or each engine ran steps (unified); drafting: the same for some decode replica drafting; verify "
              "while drafting: share of verify's busy time with a replica drafting (0 = the lanes took turns).", ""]
    lines += prefill_path_table([(point_label(p, pt), f"{pt['rate_rps']:g}/s", pt["lanes"]["prefill_path"])
                                 for p in document["placements"] for pt in p.get("sweep", [])
                                 if (pt.get("lanes") or {}).get("prefill_path")])
    lines += ["## Goodput and the decode stall", "",
              "Goodput at a bound: the most completed requests/s among a placement's rates at which every "
              f"submitted request completed, p99 TPOT was within the bound and p99 TTFT within {TTFT_SLO_MS:g} ms "
              "(measured rates only: known to within the rate grid). Stall: the rate sweep's stall at that rate. "
              "submitted = completed + failed + timed out, over the whole sweep.", "",
              rows_table(document.get("goodput", []))]
    return "\n".join(lines) + "\n"


def header(document: dict) -> list[str]:
    m, w, pair = document["machine"], document["workload"], document["pair"]
    gpus = ", ".join(f"{g['index']}: {g['name']}" for g in document["gpus"]) or "none"
    mixed = w["mixed"]
    lines = [
        f"# Lanes over two GPUs: {NAME}", "",
        f"- Machine: {m['cpu_cores']} CPU cores, GPUs {gpus}; torch {m['torch']}, Ray {m['ray']}; "
        f"commit {document['commit']}; {document['duration_s']:.0f} s in all (budget {document['budget_s']:.0f} s).",
        f"- Pair: constructed {pair['shape']} (docs/constructed_pair.md), {pair['dtype']}: target "
        f"{pair['target_parameters']:,} and draft {pair['draft_parameters']:,} parameters, "
        f"agreement {pair['agreement']:g}.",
        f"- Workload: Poisson arrivals, {w['window_s']:g} s of requests per rate (at least 8), greedy, ignore_eos; "
        f"uniform: prompts of {w['min_prompt_len']}-{w['max_prompt_len']} tokens (log-normal, median "
        f"{w['prompt_len_median']:g}), outputs {w['min_output_len']}-{w['max_output_len']} (median "
        f"{w['output_len_median']:g}); mixed: {mixed['long_share']:.0%} of prompts {mixed['long']} tokens, the rest "
        f"{mixed['prompt']}, {mixed['output']} out. A rate is saturated when a request fails or p95 TTFT passes "
        f"{w['sat_ttft_ms']:g} ms; a sweep stops at the first, after one rate between it and the last unsaturated one.",
        f"- Command: `{document['command']}`; /dev/shm (Ray's object store) {document.get('dev_shm_gib')} GiB.", ""]
    if document.get("topology"):
        lines += ["GPU links (`nvidia-smi topo -m`):", "", "```", document["topology"], "```", ""]
    return lines


def replicas_row(placement: dict) -> dict:
    t = placement.get("timings_s", {})
    groups = " / ".join("+".join(g) for g in (placement.get("placement") or {}).get("gpu_groups", []))
    return {"placement": placement["title"], "status": placement["status"],
            "GPUs (lanes sharing each)": groups or "n/a", "as intended": placement.get("as_intended"),
            **{f"{phase} s": t.get(phase) for phase in ("deploy", "warmup", "sweep")}}


def sweep_row(point: dict) -> dict:
    """A point's row (counts, throughput, latencies, stall, acceptance) and the lanes' overlap."""
    lanes = point.get("lanes", {})
    engines = " / ".join(map(str, lanes.get("engine_busy_share", [])))
    return {**point["row"], "saturated": point["saturated"],
            "in flight": round(point["summary"]["mean_in_flight"], 1),
            "busy": lanes.get("verify_busy_share", engines or None), "drafting": lanes.get("drafting_busy_share"),
            "verify while drafting": lanes.get("verify_with_drafting_share")}


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="results directory")
    parser.add_argument("--plot-only", type=Path, default=None, help="re-draw plots and tables from DIR/dual_gpu.json")
    parser.add_argument("--placements", default="a,b,d,c,a2", help="in run order (the budget may skip the last); "
                        f"of {','.join(PLACEMENTS)}")
    parser.add_argument("--workloads", default="uniform", help="swept in this order, each an equal share of a "
                        "placement's time: uniform (log-normal lengths), mixed (lib/loads.py's MIXED)")
    parser.add_argument("--shape", choices=("tinyllama-7b", "small"), default="tinyllama-7b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--agreement", type=float, default=0.8, help="the constructed pair's designed agreement")
    parser.add_argument("--pair-dir", type=Path, default=PAIR_DIR,
                        help="where the pair is saved (lib/pairs.save_pair; a finished save there is reused)")
    parser.add_argument("--rates", default=None, help="requests/s, swept in order until one saturates "
                        "(default 4,8,16,32,64,128 on cuda, 1,2 on cpu)")
    parser.add_argument("--no-refine", dest="refine", action="store_false",
                        help="no extra rate between the last unsaturated and the saturated one")
    parser.add_argument("--window-s", type=float, default=None, help="seconds of arrivals per rate (5 cuda, 4 cpu)")
    parser.add_argument("--sat-ttft-ms", type=float, default=3000.0, help="p95 TTFT that marks a rate saturated")
    parser.add_argument("--budget-s", type=float, default=500.0, help="wall-clock allowance of the whole run")
    parser.add_argument("--seed", type=int, default=0)
    lengths = ("prompt_len_median", "min_prompt_len", "max_prompt_len", "output_len_median", "min_output_len",
               "max_output_len", "request_timeout_s", "deploy_timeout_s")
    for key in lengths:  # the single-GPU benchmarks' workload (PRESETS), unless overridden
        parser.add_argument("--" + key.replace("_", "-"), type=type(PRESETS["cuda"][key]), default=None,
                            help=f"default {PRESETS['cuda'][key]} on cuda, {PRESETS['cpu'][key]} on cpu")
    args = parser.parse_args(argv)
    if args.plot_only is None and args.out is None:
        parser.error("--out is required (or --plot-only DIR)")
    for key in lengths:
        if getattr(args, key) is None:
            setattr(args, key, PRESETS[args.device][key])
    on_gpu = args.device == "cuda"
    args.rates = [float(r) for r in (args.rates or ("4,8,16,32,64,128" if on_gpu else "1,2")).split(",")]
    args.window_s = args.window_s or (5.0 if on_gpu else 4.0)
    args.dtype = PRESETS[args.device]["dtype"]
    args.placements = args.placements.split(",")
    unknown = [k for k in args.placements if k not in PLACEMENTS]
    if unknown:
        parser.error(f"unknown placements {unknown}; choose from {sorted(PLACEMENTS)}")
    args.workloads = args.workloads.split(",")
    if set(args.workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads in {args.workloads}; choose from {WORKLOADS}")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.plot_only is not None:
        document = json.loads((args.plot_only / f"{NAME}.json").read_text())
        write_results(args.plot_only, document)
        log(f"wrote plots and tables in {args.plot_only}")
        return
    deadline_s = time.monotonic() + args.budget_s
    log(f"dual_gpu: placements {args.placements} on {args.device}, budget {args.budget_s:.0f} s")
    pair = save_pair(args.shape, args.agreement, args.pair_dir, dtype=args.dtype, device=args.device, seed=args.seed)
    configs = {key: placement_args(PLACEMENTS[key], str(pair.target), str(pair.draft), args.device)
               for key in args.placements}
    fit_lengths(args, configs)
    tokenizer = load_tokenizer(pair.target)
    inventory = gpu_inventory()
    target_config, draft_config = shape_configs(args.shape)
    document = {
        "command": "python3 benchmarks/dual_gpu.py " + " ".join(argv), "machine": machine(), "gpus": inventory,
        "topology": topology(), "dev_shm_gib": shm_gib(), "commit": git_commit(), "budget_s": args.budget_s,
        "pair": {"shape": args.shape, "agreement": args.agreement, "dtype": args.dtype, "target": str(pair.target),
                 "draft": str(pair.draft), "save_s": round(pair.save_s, 1), "check": pair.check,
                 "target_parameters": parameter_count(target_config),
                 "draft_parameters": parameter_count(draft_config)},
        "workload": {k: getattr(args, k) for k in (
            "rates", "window_s", "sat_ttft_ms", "prompt_len_median", "min_prompt_len", "max_prompt_len",
            "output_len_median", "min_output_len", "max_output_len", "seed", "workloads")}
        | {"mixed": MIXED[args.device]},
        "placements": [], "duration_s": 0.0}
    port = start_model_cluster({"TOKENIZERS_PARALLELISM": "false"})
    free_bytes = [torch.cuda.mem_get_info(g["index"])[0] for g in inventory]
    log(f"Ray and Serve up (port {port}); GPUs {[g['name'] for g in inventory] or 'none'}")
    try:
        for n, key in enumerate(args.placements):
            spec, placements_left = PLACEMENTS[key], len(args.placements) - n
            left_s = deadline_s - time.monotonic() - RESERVE_S
            if left_s / placements_left < MIN_PLACEMENT_S[args.device]:
                reason = f"{left_s:.0f} s of the budget left for {placements_left} placements"
                document["placements"].append({"key": key, "title": spec.title, "status": "skipped", "reason": reason})
                log(f"{key}: skipped ({reason})")
                continue
            log(f"{key}: {spec.title}: {left_s / placements_left:.0f} s for it")
            document["placements"].append({"key": key, "title": spec.title, "status": "running"})

            def on_point(result: dict) -> None:  # a run cut short keeps every point measured
                document["placements"][-1] = result
                write_results(args.out, document, plots=False)

            document["placements"][-1] = run_placement(spec, configs[key], args, tokenizer, port,
                                                       time.monotonic() + left_s / placements_left, inventory,
                                                       on_point)
            for gpu, free in zip(inventory, free_bytes):  # the deleted replicas' memory is back
                with torch.cuda.device(gpu["index"]):
                    wait_for_device_memory(free, timeout_s=30)
            document["duration_s"] = round(args.budget_s - (deadline_s - time.monotonic()), 1)
            write_results(args.out, document, plots=False)
    finally:
        serve.shutdown()
        ray.shutdown()
    document["duration_s"] = round(args.budget_s - (deadline_s - time.monotonic()), 1)
    write_results(args.out, document)
    print((args.out / f"{NAME}.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
