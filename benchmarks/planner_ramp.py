"""The replica planner against Serve's default autoscaling policy and fixed replicas, on one load ramp (CPU).

    python -m benchmarks.planner_ramp --out benchmarks/results/planner_ramp_cpu
    python -m benchmarks.planner_ramp --ceiling 1,2,4 --out benchmarks/results/planner_ramp_cpu   # ceiling.json

The arms `planner` (`slo:`), `serve-default` and `fixed` in turn on one seeded Poisson ramp; writes <out>/results.json,
README.md (a row per arm) and ramp.png (replicas, L and the p95s against time); --ceiling instead: what each count
of fixed replicas, kept full, serves. Method: docs/controller.md (Replica planner); results: docs/planner.md.
"""

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
from ray import serve

from benchmarks.lib.apps import beside
from benchmarks.lib.cluster import deploy, git_commit, machine, serving, start_cluster
from benchmarks.lib.proc_cpu import cpu_s
from benchmarks.lib.results import pyplot, rounded, rows_table, write_document
from deployments.config import DEFAULT_DRAFT, DEFAULT_TARGET, REPO_ROOT
from loadtest.arrivals import ClosedLoop, RampLoop
from loadtest.client import RequestOptions
from loadtest.runner import RunResult, run_load
from loadtest.summary import LatencyStats
from loadtest.workload import WorkloadRequest, count_tokens, load_tokenizer
from training.corpus import collect_corpus

ARMS = ("planner", "serve-default", "fixed")
# The L controller's block calibrated for the 2-core CPU and the shipped pair (docs/controller.md, "The
# controller's block"): L = 2 gave the most tokens per second at 16 running requests, 16 x (2 + 1) tokens.
DEFAULT_CONTROLLER = {"interval_s": 0.5, "initial_draft_len": 4, "max_draft_len": 8, "draft_cost_ratio": 0.35,
                      "target_decode_p95_ms": 200, "verify_queue_high": 8, "verify_queue_low": 2,
                      "verify_token_budget": 48}
# Every key is a flag.
DEFAULTS = {"base_rps": 1.0, "peak_factor": 4.0, "hold_s": 30.0, "ramp_s": 60.0, "peak_s": 60.0, "tail_s": 60.0,
            "ttft_ms": 1500.0, "tpot_ms": 60.0, "slo": "{}", "max_num_seqs": 2, "max_replicas": 4, "fixed_replicas": 1,
            "prompt_tokens": 64, "output_tokens": 32, "num_prompts": 200, "controller": json.dumps(DEFAULT_CONTROLLER),
            "request_timeout_s": 300.0, "window_s": 10.0, "settle_s": 30.0, "target": DEFAULT_TARGET,
            "draft": DEFAULT_DRAFT, "seed": 0, "ceiling": "", "ceiling_s": 30.0}
HELP = {"base_rps": "1x: about one replica's capacity", "ttft_ms": "slo.ttft_p95_ms", "tpot_ms": "slo.tpot_p95_ms",
        "slo": "JSON merged into the planner arm's slo block", "num_prompts": "distinct prompts, cycled",
        "controller": "JSON of the L controller's block", "request_timeout_s": "the load tester's limit on one request",
        "ceiling": "comma-separated replica counts: the machine's ceiling with each instead of the ramp"}
DEPLOY_TIMEOUT_S = 300.0
TABLE = ("goodput_rps", "completed", "submitted", "failed", "timed_out", "replica_seconds", "max_replicas",
         "final_replicas", "windows_within", "settled_windows_within", "ttft_ms_p95", "tpot_ms_p95", "mean_draft_len",
         "load_average_1m", "foreign_cores")  # the README's columns


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/planner_ramp_cpu")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    for key, value in DEFAULTS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=type(value), default=value,
                            help=f"{HELP.get(key, '')} (default {value})")
    return parser.parse_args(argv)


def heldout_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    """`num_prompts` windows of `prompt_tokens` tokens spread evenly over the held-out source files (Python
    source the pair never saw: the setting in which models/pair_metrics.json measured its acceptance)."""
    tokenizer = load_tokenizer(args.target)
    heldout = collect_corpus(include_site_packages=False).heldout
    stream = [t for f in heldout for t in tokenizer.encode(f.text, add_special_tokens=False)]
    step = (len(stream) - args.prompt_tokens) // args.num_prompts
    prompts = [tokenizer.decode(stream[i * step : i * step + args.prompt_tokens]) for i in range(args.num_prompts)]
    return [WorkloadRequest(prompt=p, prompt_len=count_tokens(tokenizer, p), output_len=args.output_tokens)
            for p in prompts]


def cpu_sample() -> tuple[float, float, dict[int, float | None]]:
    """(monotonic s, busy CPU s of the machine, CPU s of each process of this benchmark's tree: the driver,
    Ray's daemons and workers, the replicas)."""
    t = psutil.cpu_times()
    busy_s = t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)
    me = psutil.Process()
    return time.monotonic(), busy_s, {p.pid: cpu_s(p.pid) for p in (me, *me.children(recursive=True))}


def foreign_cores(before: tuple, after: tuple) -> float:
    """Mean cores busy with processes outside this benchmark's tree between two `cpu_sample`s."""
    (t0, busy0, ours0), (t1, busy1, ours1) = before, after
    ours_s = sum(s - (ours0.get(pid) or 0.0) for pid, s in ours1.items() if s is not None)
    return max(0.0, (busy1 - busy0 - ours_s) / (t1 - t0)) if t1 > t0 else 0.0


def ramp(args: argparse.Namespace) -> RampLoop:
    base, peak = args.base_rps, args.base_rps * args.peak_factor
    t = np.cumsum([0, args.hold_s, args.ramp_s, args.peak_s, args.ramp_s]).tolist()
    return RampLoop(((0.0, base), (t[1], base), (t[2], peak), (t[3], peak), (t[4], base)))


def duration_s(args: argparse.Namespace) -> float:
    return args.hold_s + 2 * args.ramp_s + args.peak_s + args.tail_s


def app_configs(args: argparse.Namespace) -> dict[str, dict]:
    """Every arm's app config."""
    controller = json.loads(args.controller)
    engine = {"max_model_len": 512, "max_num_seqs": args.max_num_seqs, "max_draft_len": 8,
              "num_speculative_tokens": controller.get("initial_draft_len", 4)}
    lane = {"num_cpus": 0.05}
    base = {"mode": "unified", "target": {"path": args.target}, "draft": {"path": args.draft}, "ingress": lane,
            "engine": engine, "controller": controller}
    slo = {"ttft_p95_ms": args.ttft_ms, "tpot_p95_ms": args.tpot_ms, "max_replicas": args.max_replicas,
           **json.loads(args.slo)}
    autoscaling = {"min_replicas": 1, "max_replicas": args.max_replicas}
    return {"planner": {**base, "decode_lane": {**lane, "num_replicas": 1}, "slo": slo},
            "serve-default": {**base, "decode_lane": {**lane, "num_replicas": None, "autoscaling_config": autoscaling}},
            "fixed": {**base, "decode_lane": {**lane, "num_replicas": args.fixed_replicas}}}


async def sample(app: str, url: str, trace: list[dict], every_s: float = 1.0) -> None:
    """Every `every_s` from its start: the lane's replicas (every one Serve holds, starting and stopping too:
    what the lane pays for) and the L controller's default L, until cancelled."""
    origin_s = time.perf_counter()
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            lane = (await asyncio.to_thread(serve.status)).applications[app].deployments.get("DecodeLane")
            replicas = sum(lane.replica_states.values()) if lane is not None else 0
            try:
                state = (await http.get(f"{url}/v1/controller")).json()
            except (httpx.HTTPError, ValueError):
                state = {}
            trace.append({"t_s": round(time.perf_counter() - origin_s, 2), "replicas": replicas,
                          "draft_len": state.get("default_draft_len")})
            await asyncio.sleep(every_s)


async def measure(url: str, workload, arrivals, duration_s: float, args, sampler=None) -> tuple[RunResult, dict]:
    """A few requests first (no arm pays for cold caches), then `arrivals` for `duration_s` with `sampler`
    beside them; and the machine's other load meanwhile."""
    await run_load(url, workload[:4], RampLoop(((0.0, 1.0),)), timeout_s=args.request_timeout_s, progress=False)
    cpu_before, load_before = cpu_sample(), os.getloadavg()
    result = await beside(run_load(url, workload, arrivals, duration_s=duration_s, seed=args.seed, progress=False,
                                   options=RequestOptions(temperature=0.0), timeout_s=args.request_timeout_s), sampler)
    return result, {"foreign_cores": round(foreign_cores(cpu_before, cpu_sample()), 2),
                    "load_average_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}


def windows(result: RunResult, args) -> list[dict]:
    """Per `window_s` of request starts: requests, their TTFT and TPOT p95, and whether both are within target
    (a window with a failed request, or none measured, is not)."""
    out = []
    for start in np.arange(0.0, duration_s(args), args.window_s):
        records = [r for r in result.records if start <= r.start_s < start + args.window_s]
        ttft = LatencyStats.of([r.ttft_ms for r in records if r.ttft_ms is not None]).p95
        tpot = LatencyStats.of([r.tpot_ms for r in records if r.tpot_ms is not None]).p95
        failed = sum(r.status != "completed" for r in records)
        within = bool(records) and not failed and (ttft or math.inf) <= args.ttft_ms and (tpot or 0) <= args.tpot_ms
        out.append({"start_s": float(start), "requests": len(records), "failed": failed, "ttft_p95_ms": ttft,
                    "tpot_p95_ms": tpot, "within": within})
    return out


def share_within(wins: list[dict]) -> float | None:
    return round(sum(w["within"] for w in wins) / len(wins), 3) if wins else None


def arm_row(result: RunResult, trace: list[dict], load: dict, args) -> dict:
    s = result.summary({"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms})
    assert s.submitted == s.completed + s.failed + s.timed_out == len(result.records)
    wins = windows(result, args)
    turns = (args.hold_s, args.hold_s + args.ramp_s)  # settled: not within settle_s of the rise or the peak
    settled = [w for w in wins if not any(t <= w["start_s"] < t + args.settle_s for t in turns)]
    lengths = [p["draft_len"] for p in trace if p["draft_len"] is not None]
    return {
        "submitted": s.submitted, "completed": s.completed, "failed": s.failed, "timed_out": s.timed_out,
        "wall_s": round(s.wall_s, 1), "goodput_rps": round(s.goodput_rps, 3),
        "throughput_rps": round(s.request_throughput_rps, 3),
        "ttft_ms_p95": s.latency_ms["ttft_ms"].p95, "tpot_ms_p95": s.latency_ms["tpot_ms"].p95,
        "replica_seconds": round(sum(b["replicas"] * (b["t_s"] - a["t_s"]) for a, b in zip(trace, trace[1:])), 1),
        "max_replicas": max(p["replicas"] for p in trace), "final_replicas": trace[-1]["replicas"],
        "windows_within": share_within(wins), "settled_windows_within": share_within(settled),
        "mean_draft_len": round(statistics.mean(lengths), 2) if lengths else None,
        **load, "windows": wins, "trace": trace, "summary": s.to_dict(),
    }


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    args = report["args"]
    for name, row in report["arms"].items():
        t = [p["t_s"] for p in row["trace"]]
        axes[0].step(t, [p["replicas"] for p in row["trace"]], where="post", label=name)
        axes[1].step(t, [p["draft_len"] for p in row["trace"]], where="post", label=name)
        w = [x["start_s"] + args["window_s"] / 2 for x in row["windows"]]
        axes[2].plot(w, [x["ttft_p95_ms"] for x in row["windows"]], marker=".", label=name)
        axes[3].plot(w, [x["tpot_p95_ms"] for x in row["windows"]], marker=".", label=name)
    axes[2].axhline(args["ttft_ms"], color="grey", ls="--")
    axes[3].axhline(args["tpot_ms"], color="grey", ls="--")
    axes[2].set_yscale("log")
    for ax, label in zip(axes, ("replicas", "draft length L", "TTFT p95 (ms), 10 s windows", "TPOT p95 (ms)")):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    rate, schedule = axes[3].twinx(), report["schedule"]
    rate.plot([p[0] for p in schedule] + [report["duration_s"]], [p[1] for p in schedule] + [schedule[-1][1]],
              color="black", alpha=0.3)
    rate.set_ylabel("offered req/s")
    axes[0].legend()
    axes[3].set_xlabel("seconds since the ramp started")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def markdown(report: dict) -> str:
    a = report["args"]
    rows = [{"arm": name, **rounded({k: r[k] for k in TABLE})} for name, r in report["arms"].items()]
    lines = [
        "# Replica planner vs Serve's default policy vs fixed replicas: one load ramp on the CPU",
        "", f"Command: `{report['command']}` at commit {report['commit']}. Machine: {report['machine']}.", "",
        f"Mode unified, the shipped pair, max_num_seqs {a['max_num_seqs']} a replica, {a['prompt_tokens']}-token "
        f"prompts, {a['output_tokens']} output tokens, greedy, the L controller on. Poisson ramp: {a['base_rps']:g} "
        f"req/s for {a['hold_s']:g} s, up to {a['peak_factor']:g}x over {a['ramp_s']:g} s, held {a['peak_s']:g} s, "
        f"down over {a['ramp_s']:g} s, {a['tail_s']:g} s at 1x. Targets: TTFT p95 {a['ttft_ms']:g} ms, TPOT p95 "
        f"{a['tpot_ms']:g} ms; goodput, windows of {a['window_s']:g} s ({a['settle_s']:g} s to settle), "
        "load_average_1m (start, end) and foreign_cores as docs/controller.md defines them.", "",
        rows_table(rows, labels=1), "![replicas, L and latency against time](ramp.png)", ""]
    if report.get("errors"):
        lines += ["## Arms not measured", ""] + [f"- {name}: {why}" for name, why in report["errors"].items()] + [""]
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    if report["arms"]:
        plot(report, out / "ramp.png")
    (out / "README.md").write_text(markdown(report))


def run_arms(args: argparse.Namespace, url: str, workload, report: dict) -> None:
    """Each arm in turn: deployed, its ramp run, deleted; the report rewritten after each."""
    for name, config in report["app_configs"].items():
        try:
            trace: list[dict] = []
            deploy(name, config, DEPLOY_TIMEOUT_S)
            try:
                result, load = asyncio.run(measure(f"{url}/{name}", workload, ramp(args), duration_s(args), args,
                                                   sample(name, f"{url}/{name}", trace)))
            finally:
                serve.delete(name)  # waits until its replicas have stopped
            report["arms"][name] = r = arm_row(result, trace, load, args)
            print(f"{name}: goodput {r['goodput_rps']:.2f} req/s, {r['completed']}/{r['submitted']} completed, "
                  f"{r['replica_seconds']:.0f} replica-s, settled windows within {r['settled_windows_within']}",
                  flush=True)
        except Exception as exc:  # one arm failing leaves the others measured
            report["errors"][name] = repr(exc)
            print(f"{name}: failed: {exc!r}", flush=True)
        write_report(report, args.out)  # after every arm: a run cut short keeps what it measured


def ceiling(args: argparse.Namespace, url: str, workload, command: str) -> None:
    """What the machine serves with each count of fixed replicas, each kept full: out/ceiling.json and .md."""
    rows = []
    for replicas in (int(n) for n in args.ceiling.split(",")):
        args.fixed_replicas, name, in_flight = replicas, f"ceiling{replicas}", 2 * replicas * args.max_num_seqs
        deploy(name, app_configs(args)["fixed"], DEPLOY_TIMEOUT_S)
        try:
            result, load = asyncio.run(measure(f"{url}/{name}", workload, ClosedLoop(in_flight), args.ceiling_s, args))
        finally:
            serve.delete(name)
        s = result.summary({})
        rows.append({"replicas": replicas, "in_flight": in_flight, "completed": s.completed,
                     "failed": s.failed + s.timed_out, "request_rps": round(s.request_throughput_rps, 3),
                     "output_tps": round(s.output_token_throughput_tps, 1), "ttft_ms_p95": s.latency_ms["ttft_ms"].p95,
                     "tpot_ms_p95": s.latency_ms["tpot_ms"].p95, **load})
        print(rows[-1], flush=True)
    write_document(args.out, "ceiling", {"command": command, "rows": rows}, rows_table(rows, labels=1))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    every, m = app_configs(args), machine()
    report = {
        "command": " ".join(["python -m benchmarks.planner_ramp", *(argv or [])]), "commit": git_commit(),
        "machine": f"{m['cpu_cores']} CPU cores ({m['cpu_model']}), {m['gpu'] or 'no GPU'}",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "schedule": ramp(args).points, "duration_s": duration_s(args),
        "app_configs": {name: every[name] for name in args.arms.split(",")}, "arms": {}, "errors": {},
    }
    workload = heldout_workload(args)
    with serving(start_cluster()) as port:
        url = f"http://127.0.0.1:{port}"
        if args.ceiling:
            return ceiling(args, url, workload, report["command"])
        run_arms(args, url, workload, report)  # the report written after each arm
    print(markdown(report))


if __name__ == "__main__":
    main(sys.argv[1:])
