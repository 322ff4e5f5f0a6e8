"""Compare the five serving modes on this machine with one seeded synthetic workload.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compare_modes.py            # what was committed
    .venv/bin/python benchmarks/compare_modes.py --modes nospec,pdv --num-requests 16 --name quick

Each mode is deployed with `serve.run` from the args of configs/<mode>.yaml (the app that
`serve run configs/<mode>.yaml` deploys; model paths made absolute, or replaced by --target and
--draft) on one Ray cluster of this machine, driven by the load tester at each concurrency, then
deleted before the next mode is deployed, so modes never share the CPU. Every mode gets the same
requests.

Writes, under --output-dir (default benchmarks/results):

    <name>.json                machine, models, workload, per-mode summaries, every request
    <name>.csv / <name>.md     the side-by-side table: metrics as rows, a column per mode and load
    <name>_latency_cdf.png     CDFs of TTFT, TPOT, ITL and E2E, one line per mode and load
    <name>_load_curve.png      throughput and p95 latencies against concurrency (several loads)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd
import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.cluster import (ALL_MODES, REPO, count_parameters, git_commit,  # noqa: E402
                                    load_average, machine, mode_args, start_cluster)
from deployments.builder import build_app  # noqa: E402
from loadtest.arrivals import ClosedLoop  # noqa: E402
from loadtest.report import (Point, comparison_table, markdown_table,  # noqa: E402
                             plot_latency_cdfs, plot_load_curves)
from loadtest.runner import run_load  # noqa: E402
from loadtest.summary import parse_slos  # noqa: E402
from loadtest.workload import LogNormal, WorkloadRequest, load_tokenizer, synthetic  # noqa: E402

# The machine is shared: its 1-minute load average when each run ended goes into the table.
LOAD_ROW = "load_average_1m_at_end"
SUMMARY_ROWS = ["submitted", "completed", "failed", "timed_out", "wall_s",
                "request_throughput_rps", "output_token_throughput_tps", "goodput_rps",
                "ttft_ms p50", "ttft_ms p95", "tpot_ms p50", "tpot_ms p95", "itl_ms p50",
                "e2e_ms p50", "e2e_ms p95", "acceptance_rate", "mean_acceptance_length", LOAD_ROW]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(ALL_MODES))
    parser.add_argument("--target", type=Path, default=None, help="default: configs' target")
    parser.add_argument("--draft", type=Path, default=None, help="default: configs' draft")
    parser.add_argument("--concurrencies", default="1,4", help="closed-loop loads, e.g. 1,4")
    parser.add_argument("--num-requests", type=int, default=24, help="measured requests per load")
    parser.add_argument("--warmup-requests", type=int, default=3)
    parser.add_argument("--prompt-len-median", type=float, default=64)
    parser.add_argument("--output-len-median", type=float, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--slo", action="append", default=None, metavar="NAME=MS",
                        help="goodput SLO (repeat); default ttft_ms=1000 and tpot_ms=50")
    parser.add_argument("--name", default="mode_compare_cpu")
    parser.add_argument("--output-dir", type=Path, default=REPO / "benchmarks" / "results")
    return parser.parse_args(argv)


def workload(args: argparse.Namespace, tokenizer_dir: str) -> tuple[list[WorkloadRequest],
                                                                    list[WorkloadRequest]]:
    """(warm-up, measured) requests, drawn once and sent to every mode."""
    prompt_lengths = LogNormal(args.prompt_len_median, 1.0, 4, args.max_prompt_len)
    output_lengths = LogNormal(args.output_len_median, 0.8, 4, args.max_output_len)
    requests = synthetic(load_tokenizer(tokenizer_dir), args.warmup_requests + args.num_requests,
                         args.seed, prompt_lengths, output_lengths)
    return requests[:args.warmup_requests], requests[args.warmup_requests:]


def run_mode(mode: str, app_args: dict, port: int, loads: list[ClosedLoop],
             warmup: list[WorkloadRequest], requests: list[WorkloadRequest],
             slos: dict[str, float], timeout_s: float, seed: int) -> list[tuple[Point, float]]:
    """Deploy `mode`, run every load against it, delete it; each run comes with the machine's
    1-minute load average when it ended."""
    started_s = time.monotonic()
    serve.run(build_app(app_args), name=mode, route_prefix=f"/{mode}")
    print(f"{mode}: deployed in {time.monotonic() - started_s:.1f} s", flush=True)
    runs = []
    try:
        for arrivals in loads:
            result = asyncio.run(run_load(f"http://127.0.0.1:{port}/{mode}", requests, arrivals,
                                          warmup=warmup, timeout_s=timeout_s, seed=seed,
                                          progress=False))
            point = Point(label=mode, result=result, summary=result.summary(slos))
            s = point.summary
            print(f"  {point.name}: {s.completed}/{s.submitted} completed, {s.failed} failed, "
                  f"{s.timed_out} timed out, {s.output_token_throughput_tps:.1f} output tok/s",
                  flush=True)
            runs.append((point, os.getloadavg()[0]))
    finally:
        serve.delete(mode)  # blocks until Serve has removed the app and its replicas
    return runs


def models(app_args: dict) -> dict:
    """Both models' paths and sizes, and the pair's offline acceptance where it was measured."""
    target, draft = app_args["target"]["path"], app_args["draft"]["path"]
    metrics_file = Path(target).parent / "pair_metrics.json"
    offline = None
    if metrics_file.exists():
        measured = json.loads(metrics_file.read_text())
        draft_len = str(app_args["engine"]["num_speculative_tokens"])
        offline = {"source": str(metrics_file.relative_to(REPO) if metrics_file.is_relative_to(REPO)
                                 else metrics_file),
                   f"greedy_draft_len_{draft_len}": measured["greedy"].get(draft_len),
                   "heldout_loss": measured.get("heldout_loss")}
    return {"target": {"path": _shown(target), "parameters": count_parameters(target),
                       "dtype": app_args["target"]["dtype"]},
            "draft": {"path": _shown(draft), "parameters": count_parameters(draft),
                      "dtype": app_args["draft"]["dtype"]},
            "offline_acceptance": offline}


def _shown(path: str) -> str:
    return str(Path(path).relative_to(REPO)) if Path(path).is_relative_to(REPO) else path


def write_results(args: argparse.Namespace, runs: list[tuple[Point, float]],
                  context: dict) -> None:
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    points = [point for point, _ in runs]
    table = comparison_table(points)
    table.loc[LOAD_ROW] = [round(load, 2) for _, load in runs]
    table.to_csv(out / f"{args.name}.csv")
    document = {**context, "table": json.loads(table.to_json()),
                "runs": [_run_document(p) for p in points]}
    (out / f"{args.name}.json").write_text(json.dumps(document, indent=1))
    (out / f"{args.name}.md").write_text(_markdown(args, table, points, context))
    plot_latency_cdfs(points, out / f"{args.name}_latency_cdf.png")
    if len({p.result.arrivals for p in points}) > 1:
        plot_load_curves(points, out / f"{args.name}_load_curve.png")


def _run_document(point: Point) -> dict:
    # Every request, without its list of inter-token gaps (the CDF plot shows those).
    requests = [{k: v for k, v in r.to_row().items() if k != "itl_ms"}
                for r in point.result.records]
    return {"mode": point.label, "load": point.result.arrivals.label,
            "summary": point.summary.to_dict(), "requests": requests}


def _markdown(args: argparse.Namespace, table: pd.DataFrame, points: list[Point],
              context: dict) -> str:
    m, w = context["machine"], context["workload"]
    target, draft = context["models"]["target"], context["models"]["draft"]
    offline = context["models"]["offline_acceptance"]
    lines = [f"# Mode comparison: {args.name}", "",
             f"- Machine: {m['cpu_cores']}-core {m['cpu_model']} CPU, "
             f"{'GPU ' + m['gpu'] if m['gpu'] else 'no GPU'}, {m['memory_gib']} GiB; "
             f"torch {m['torch']}, Ray {m['ray']}, OMP_NUM_THREADS={m['omp_num_threads']}; "
             f"load average {context['load_average_before']} before, "
             f"{context['load_average_after']} after. The machine is shared with other "
             f"jobs: the row {LOAD_ROW} gives its 1-minute load average as each run ended (above "
             f"{m['cpu_cores']}, runs waited for a core), so compare columns of similar load.",
             f"- Models: target {target['path']} ({target['parameters']:,} parameters), "
             f"draft {draft['path']} ({draft['parameters']:,} parameters), "
             f"{target['dtype']} / {draft['dtype']}.",
             f"- Offline acceptance of the pair ({offline['source']}): "
             f"{json.dumps({k: v for k, v in offline.items() if k != 'source'})}."
             if offline else "- No offline acceptance measured for this pair.",
             f"- Workload: {w['num_requests']} measured + {w['warmup_requests']} warm-up synthetic "
             f"requests per load (seed {w['seed']}; random-token prompts, median "
             f"{w['prompt_len_median']:g} tokens; outputs median {w['output_len_median']:g}, "
             f"ignore_eos, greedy), the same for every mode; closed loop at concurrency "
             f"{w['concurrencies']}; goodput SLOs {w['slos']} (ms). Random prompts are not "
             "code, so acceptance here is not the pair's acceptance on Python.",
             "- Modes deployed one at a time from configs/<mode>.yaml; "
             f"commit {context['commit']}; "
             f"{context['duration_s']:.0f} s in all.",
             f"- Command: `{context['command']}`", "",
             f"Full table: {args.name}.csv; plots: {args.name}_latency_cdf.png, "
             f"{args.name}_load_curve.png.", ""]
    return "\n".join(lines + _tables_by_load(table, points))


def _tables_by_load(table: pd.DataFrame, points: list[Point]) -> list[str]:
    """The main rows of the table, one Markdown table per load with a column per mode."""
    sections = []
    for load in dict.fromkeys(p.result.arrivals.label for p in points):
        mine = [p for p in points if p.result.arrivals.label == load]
        part = table.loc[SUMMARY_ROWS, [p.name for p in mine]]
        part.columns = [p.label for p in mine]
        sections += [f"## {load}", "", markdown_table(part)]
    return sections


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started_s = time.monotonic()
    modes = args.modes.split(",")
    loads = [ClosedLoop(int(c)) for c in args.concurrencies.split(",")]
    slos = parse_slos(args.slo or ["ttft_ms=1000", "tpot_ms=50"])
    configs = {mode: mode_args(mode, args.target, args.draft) for mode in modes}
    warmup, requests = workload(args, configs[modes[0]]["target"]["path"])
    context = run_context(args, argv, configs, loads, slos, warmup, requests)
    port = start_cluster()
    try:
        runs = [run for mode in modes
                for run in run_mode(mode, configs[mode], port, loads, warmup, requests, slos,
                                    args.timeout_s, args.seed)]
    finally:
        serve.shutdown()
        ray.shutdown()
    context |= {"load_average_after": load_average(),
                "duration_s": time.monotonic() - started_s}
    write_results(args, runs, context)
    print((args.output_dir / f"{args.name}.md").read_text())


def run_context(args: argparse.Namespace, argv: list[str], configs: dict[str, dict],
                loads: list[ClosedLoop], slos: dict[str, float], warmup: list[WorkloadRequest],
                requests: list[WorkloadRequest]) -> dict:
    """What the results must say about where and how they were measured."""
    shown_configs = {mode: {**config, **{role: {**config[role],
                                                "path": _shown(config[role]["path"])}
                                         for role in ("target", "draft")}}
                     for mode, config in configs.items()}
    return {"machine": machine(), "models": models(next(iter(configs.values()))),
            "commit": git_commit(),
            "command": " ".join(["OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compare_modes.py",
                                 *argv]).strip(),
            "workload": {"num_requests": len(requests), "warmup_requests": len(warmup),
                         "seed": args.seed, "prompt_len_median": args.prompt_len_median,
                         "output_len_median": args.output_len_median,
                         "prompt_tokens": sum(r.prompt_len for r in requests),
                         "output_tokens": sum(r.output_len for r in requests),
                         "concurrencies": [a.concurrency for a in loads], "slos": slos},
            "configs": shown_configs, "load_average_before": load_average()}


if __name__ == "__main__":
    main()
