"""Lanes placed over the two GPUs of one host, against one GPU and against data parallelism.

Each placement (a file of configs/placements/) is deployed in turn in one Ray cluster: where every
replica runs (checked against what the file means), a warm-up, a Poisson rate sweep per workload with
the lanes' overlap, all within --budget-s. Method and results: docs/dual_gpu.md.

    python3 benchmarks/dual_gpu.py --out DIR                       # two-GPU host, under 9 minutes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dual_gpu.py --shape small --device cpu \
        --budget-s 1300 --out DIR                                  # CPU dry run: every step, no GPUs

Writes DIR/dual_gpu.json (everything, every request) and dual_gpu.md (the tables; goodput at p99 TPOT
15/20/30 ms), rewritten after every point. The goodput command (mixed traffic): docs/dual_gpu.md.
"""

import argparse
import math
import sys
import time
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Callable

import torch
import yaml
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lib.timelines import prefill_path_table, timelines  # noqa: E402
from benchmarks.lib.apps import PRESETS, AppRun, deploy_app, lane_reader, last_point, run_loads  # noqa: E402
from benchmarks.lib.cluster import (REPO, STARTED_S, git_commit, gpu_inventory, log, machine, serving,  # noqa: E402
                                    shm_gib, start_model_cluster, topology, wait_for_device_memory)
from benchmarks.lib.loads import MIXED, Load, mixed_requests, warmup_requests  # noqa: E402
from benchmarks.lib.pairs import save_pair  # noqa: E402
from benchmarks.lib.results import (TPOT_SLOS_MS, TTFT_SLO_MS, goodput, request_rows, row,  # noqa: E402
                                    rows_table, script_parser, write_document)
from deployments.config import AppConfig  # noqa: E402
from loadtest.arrivals import OpenLoop  # noqa: E402
from loadtest.workload import LogNormal, WorkloadRequest, load_tokenizer, synthetic  # noqa: E402

NAME = "dual_gpu"
RESERVE_S = 20.0  # kept back from the budget for the last results
MIN_PLACEMENT_S = {"cuda": 75.0, "cpu": 60.0}  # less, and a placement cannot deploy, warm up and run two rates
DELETE_S = 10.0  # what removing an app takes, allowed for in every placement
WORKLOADS = ("uniform", "mixed")
# The uniform workload's log-normal lengths: the single-GPU benchmarks' (PRESETS).
LENGTHS = ("prompt_len_median", "min_prompt_len", "max_prompt_len", "output_len_median", "min_output_len",
           "max_output_len")


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
    return [tuple(g) for g in observed["gpu_groups"]] == sorted(spec.gpus) if observed["gpu_groups"] else None


def placement_args(spec: PlacementSpec, target: str, draft: str, device: str) -> dict:
    """The `args:` of the placement's config with this run's pair; on the CPU, the same graph (modes,
    replica counts) on CPU-sized engines: no GPUs, small pools, fp32."""
    args = yaml.safe_load((REPO / "configs" / "placements" / spec.config).read_text())["applications"][0]["args"]
    args["target"]["path"], args["draft"]["path"] = target, draft
    if device == "cpu":
        for lane in ("ingress", "prefill_lane", "decode_lane", "verify_lane"):
            if lane in args:
                args[lane] |= {"num_gpus": 0, "num_cpus": 0.1}
        args["engine"] |= {"max_model_len": 640, "max_num_seqs": 8, "prefill_chunk_tokens": 128}
        args["target"]["dtype"] = args["draft"]["dtype"] = "float32"
    AppConfig.model_validate(args)  # a config error names the field before anything starts
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
    context = min(AppConfig.model_validate(c).engine.max_model_len for c in configs.values())
    longest = context - args.max_output_len - 8
    if args.max_prompt_len > longest:
        log(f"max prompt {args.max_prompt_len} -> {longest} tokens (context {context})")
        args.max_prompt_len = longest


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


def run_placement(spec: PlacementSpec, app_args: dict, args: argparse.Namespace, tokenizer, port: int,
                  deadline_s: float, inventory: list[dict], result: dict, save: Callable[[], None]) -> None:
    """Deploy, check where replicas run, warm up, sweep each workload, remove the app; into `result`,
    with `save()` after every point."""
    mode, timings_s, run = app_args["mode"], {}, AppRun(spec.key)
    result |= {"config": f"configs/placements/{spec.config}", "app_args": app_args, "timings_s": timings_s}

    def record(run: AppRun) -> None:
        result["sweep"] = sweep_points(run, args.sat_ttft_ms)
        save()

    if not deploy_app(run, app_args, timeout_s=max(30.0, deadline_s - time.monotonic() - DELETE_S)):
        result |= {"status": "failed", "error": run.error, "replica_logs": run.replica_logs}
        return
    timings_s["deploy"] = round(run.deploy_s, 1)
    try:
        observed = observed_gpus(timelines(spec.key, mode, time.time()), inventory)
        result |= {"placement": observed, "as_intended": as_intended(spec, observed),
                   "asked_num_gpus": replica_gpus(app_args)}
        log(f"{spec.key}: GPUs {observed['gpu_groups'] or 'none (CPU)'}, as intended: {result['as_intended']}")
        sweeps_end_s, phase_s = deadline_s - DELETE_S, time.monotonic()
        options = dict(request_timeout_s=args.request_timeout_s, seed=args.seed, request_counters=True,
                       on_point=record, lanes_of=lane_reader(spec.key, mode))
        warm_up(run, port, app_args, args, tokenizer, sweeps_end_s, options)
        timings_s["warmup"] = round(time.monotonic() - phase_s, 1)
        phase_s = time.monotonic()
        for n, workload in enumerate(args.workloads):  # each workload an equal share of the time left
            share_s = (sweeps_end_s - time.monotonic()) / (len(args.workloads) - n)
            sweep(run, port, workload, args, tokenizer, time.monotonic() + share_s, options)
        timings_s["sweep"] = round(time.monotonic() - phase_s, 1)
    except Exception as exc:  # noqa: BLE001 - recorded; the next placement still runs
        run.failed(f"{type(exc).__name__}: {exc}")
    finally:
        try:
            serve.delete(spec.key)
        except Exception as exc:  # noqa: BLE001
            log(f"{spec.key}: delete failed: {exc}")
    result |= {"status": run.status, "sweep": sweep_points(run, args.sat_ttft_ms), "skipped_loads": run.skipped}
    if run.error:
        result |= {"error": run.error, "replica_logs": run.replica_logs}


def warm_up(run: AppRun, port: int, app_args: dict, args: argparse.Namespace, tokenizer, deadline_s: float,
            options: dict) -> None:
    """A burst as large as the app's decode slots (every CUDA-graph batch bucket passed going down),
    with two long prompts when mixed traffic follows: a placement meets long prompts first here."""
    cfg, long_prompts = AppConfig.model_validate(app_args), 2 if "mixed" in args.workloads else 0
    slots = cfg.engine.max_num_seqs * (cfg.decode_lane.num_replicas or 1)
    requests = warmup_requests(tokenizer, slots, args.seed + 7, prompt_lengths(args), long_prompts,
                               MIXED[args.device]["long"])
    run_loads(run, port, [Load("warmup", requests, OpenLoop(math.inf), measured=False)], deadline_s, **options)


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
        if not saturated(point.summary.to_dict(), args.sat_ttft_ms):
            last_ok = rate
            continue
        between = round(math.sqrt(last_ok * rate), 2) if last_ok is not None else None
        rates = [between] if between is not None and between not in args.rates + [rate] else []
        last_ok = None  # after the rate between, stop whatever it shows


def saturated(summary: dict, sat_ttft_ms: float) -> bool:
    """A request failed or timed out, or p95 TTFT shows queueing (`summary`: Summary.to_dict())."""
    ttft_p95 = summary["latency_ms"]["ttft_ms"]["p95"]
    return summary["completed"] < summary["submitted"] or ttft_p95 is None or ttft_p95 > sat_ttft_ms


def sweep_points(run: AppRun, sat_ttft_ms: float) -> list[dict]:
    """The measured points as the results keep them, each with its row (counts, p99s, decode stall),
    by workload in run order, then by rate."""
    points = []
    for load, point in run.points:
        if load.measured:
            workload, summary = load.name.split()[0], point.summary.to_dict()
            points.append({"workload": workload, "rate_rps": load.arrivals.rate_rps, "summary": summary,
                           "saturated": saturated(summary, sat_ttft_ms), "lanes": run.lanes.get(load.name, {}),
                           "row": row(point, placement=run.name, workload=workload), "requests": request_rows(point)})
    workloads = list(dict.fromkeys(p["workload"] for p in points))
    return sorted(points, key=lambda p: (workloads.index(p["workload"]), p["rate_rps"]))


def goodput_table(document: dict) -> list[dict]:
    """Per placement and workload: goodput at each p99 TPOT bound (results.goodput), the p99 decode
    stall at that rate, and every request the sweep submitted."""
    rows = []
    for placement in document["placements"]:
        for workload, group in groupby(placement.get("sweep", []), key=lambda point: point["workload"]):
            points = list(group)  # sweep_points keeps a workload's points together
            counts = {k: sum(p["summary"][k] for p in points)
                      for k in ("submitted", "completed", "failed", "timed_out")}
            row = {"placement": placement["key"], "workload": workload, **counts}
            for bound in TPOT_SLOS_MS:
                best = goodput(points, bound)
                rps = round(best["summary"]["request_throughput_rps"], 2) if best else None
                row[f"goodput rps, TPOT<={bound:g}"] = rps
                row[f"stall ms p99, TPOT<={bound:g}"] = best["row"]["stall_ms p99"] if best else None
            rows.append(row)
    return rows


def write_results(out: Path, document: dict) -> None:
    document["duration_s"] = round(time.monotonic() - STARTED_S, 1)
    document["goodput"] = goodput_table(document)
    write_document(out, NAME, document, markdown(document))


def markdown(document: dict) -> str:
    placements = document["placements"]
    points = [(p, pt) for p in placements for pt in p.get("sweep", [])]
    lines = header(document) + ["## Where each replica ran", "", rows_table([replicas_row(p) for p in placements])]
    lines += [f"- {p['key']} {p['status']}: `{p.get('error') or p.get('reason')}`" for p in placements
              if p.get("error") or p.get("reason")]
    lines += ["", "## Rate sweep", "", rows_table([sweep_row(pt) for _, pt in points]),
              "stall, acceptance, busy, drafting, verify while drafting: docs/dual_gpu.md.", ""]
    lines += prefill_path_table([(p["key"] + ("" if pt["workload"] == "uniform" else f" {pt['workload']}"),
                                  f"{pt['rate_rps']:g}/s", pt["lanes"]["prefill_path"])
                                 for p, pt in points if (pt.get("lanes") or {}).get("prefill_path")])
    lines += ["## Goodput and the decode stall", "",
              "Goodput at a bound: the most completed requests/s among a placement's rates with every request "
              f"completed, p99 TPOT within the bound and p99 TTFT within {TTFT_SLO_MS:g} ms; stall: the sweep's at "
              "that rate; submitted = completed + failed + timed out, over the whole sweep.", "",
              rows_table(document.get("goodput", []))]
    return "\n".join(lines) + "\n"


def header(document: dict) -> list[str]:
    m, w, pair = document["machine"], document["workload"], document["pair"]
    gpus = ", ".join(f"{g['index']}: {g['name']}" for g in document["gpus"]) or "none"
    lines = [
        f"# Lanes over two GPUs: {NAME}", "",
        f"- Machine: {m['cpu_cores']} CPU cores, GPUs {gpus}; torch {m['torch']}, Ray {m['ray']}; "
        f"commit {document['commit']}; {document['duration_s']:.0f} s in all (budget {document['budget_s']:.0f} s).",
        f"- Pair: constructed {pair['shape']} (docs/constructed_pair.md), {pair['dtype']}, "
        f"agreement {pair['agreement']:g}.",
        f"- Workload (docs/dual_gpu.md; lengths in the JSON): Poisson, {w['window_s']:g} s of requests a rate, "
        f"uniform prompts up to {w['max_prompt_len']} tokens; saturated: a request lost or p95 TTFT over "
        f"{w['sat_ttft_ms']:g} ms.",
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
    return {**point["row"], "saturated": point["saturated"], "in flight": round(point["summary"]["mean_in_flight"], 1),
            "busy": lanes.get("verify_busy_share", engines or None), "drafting": lanes.get("drafting_busy_share"),
            "verify while drafting": lanes.get("verify_with_drafting_share")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__, budget_s=500.0, pair=True)  # and --shape, --agreement, --seed
    parser.add_argument("--placements", default="a,b,d,c,a2", help="in run order (the budget may skip the last); "
                        f"of {','.join(PLACEMENTS)}")
    parser.add_argument("--workloads", default="uniform", help="swept in this order, each an equal share of a "
                        "placement's time: uniform (log-normal lengths), mixed (lib/loads.py's MIXED)")
    parser.add_argument("--rates", default=None, help="requests/s, swept in order until one saturates "
                        "(default 4,8,16,32,64,128 on cuda, 1,2 on cpu)")
    parser.add_argument("--sat-ttft-ms", type=float, default=3000.0, help="p95 TTFT that marks a rate saturated")
    args = parser.parse_args(argv)
    vars(args).update({key: PRESETS[args.device][key] for key in LENGTHS + ("dtype", "request_timeout_s")})
    on_gpu = args.device == "cuda"
    args.rates = [float(r) for r in (args.rates or ("4,8,16,32,64,128" if on_gpu else "1,2")).split(",")]
    args.window_s = 5.0 if on_gpu else 4.0  # seconds of arrivals a rate
    args.placements, args.workloads = args.placements.split(","), args.workloads.split(",")
    if set(args.placements) - set(PLACEMENTS) or set(args.workloads) - set(WORKLOADS):
        parser.error(f"choose placements from {sorted(PLACEMENTS)} and workloads from {WORKLOADS}")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    deadline_s = time.monotonic() + args.budget_s
    log(f"dual_gpu: placements {args.placements} on {args.device}, budget {args.budget_s:.0f} s")
    pair = save_pair(args.shape, args.agreement, args.pair_dir, dtype=args.dtype, device=args.device, seed=args.seed)
    configs = {key: placement_args(PLACEMENTS[key], str(pair.target), str(pair.draft), args.device)
               for key in args.placements}
    fit_lengths(args, configs)
    tokenizer = load_tokenizer(pair.target)
    inventory = gpu_inventory()
    document = {
        "command": "python3 benchmarks/dual_gpu.py " + " ".join(argv), "machine": machine(), "gpus": inventory,
        "topology": topology(), "dev_shm_gib": shm_gib(), "commit": git_commit(), "budget_s": args.budget_s,
        "pair": {"shape": args.shape, "agreement": args.agreement, "dtype": args.dtype, "target": str(pair.target),
                 "draft": str(pair.draft), "save_s": round(pair.save_s, 1), "check": pair.check},
        "workload": {k: getattr(args, k) for k in ("rates", "window_s", "sat_ttft_ms", "seed", "workloads") + LENGTHS}
        | {"mixed": MIXED[args.device]},
        "placements": []}
    with serving(start_model_cluster({"TOKENIZERS_PARALLELISM": "false"})) as port:
        free_bytes = [torch.cuda.mem_get_info(g["index"])[0] for g in inventory]
        log(f"Ray and Serve up (port {port}); GPUs {[g['name'] for g in inventory] or 'none'}")
        for n, key in enumerate(args.placements):
            spec, placements_left = PLACEMENTS[key], len(args.placements) - n
            left_s = deadline_s - time.monotonic() - RESERVE_S
            if left_s / placements_left < MIN_PLACEMENT_S[args.device]:
                reason = f"{left_s:.0f} s of the budget left for {placements_left} placements"
                document["placements"].append({"key": key, "title": spec.title, "status": "skipped", "reason": reason})
                log(f"{key}: skipped ({reason})")
                continue
            log(f"{key}: {spec.title}: {left_s / placements_left:.0f} s for it")
            result = {"key": key, "title": spec.title, "status": "running", "sweep": []}
            document["placements"].append(result)  # a run cut short keeps every point measured
            run_placement(spec, configs[key], args, tokenizer, port, time.monotonic() + left_s / placements_left,
                          inventory, result, save=lambda: write_results(args.out, document))
            for gpu, free in zip(inventory, free_bytes):  # the deleted replicas' memory is back
                with torch.cuda.device(gpu["index"]):
                    wait_for_device_memory(free, timeout_s=30)
            write_results(args.out, document)
    write_results(args.out, document)
    print((args.out / f"{NAME}.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
