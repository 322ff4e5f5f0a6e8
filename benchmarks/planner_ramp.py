"""The replica planner against Serve's default autoscaling policy and fixed replicas, on one load ramp.

    python -m benchmarks.planner_ramp --out benchmarks/results/planner_ramp_cpu

Deploys the shipped pair (models/vpd-target + models/vpd-draft) in mode unified, one arm at a time (so that
no other arm's replicas share the cores), each with the draft-length controller on (`--controller`, the
CPU-calibrated block DEFAULT_CONTROLLER), every replica small (`--max-num-seqs`) so that the ramp's peak needs
several:
    planner        `slo:` with the targets below: the replica planner (controller/planner.py) as the lane's
                   Serve autoscaling policy, 1 to `--max-replicas` replicas;
    serve-default  Serve's default policy at its documented settings (target_ongoing_requests 2,
                   upscale_delay_s 30, downscale_delay_s 600, look_back_period_s 30), 1 to `--max-replicas`;
    fixed          `--fixed-replicas` replicas (1: what both autoscaled arms start at).
Each arm gets the same seeded open-loop arrivals (loadtest.arrivals.RampLoop): `--base-rps` (1x) for
`hold` seconds, up to `--peak-factor` x over `ramp` seconds, held `peak` seconds, down over `ramp` seconds,
1x for `tail` seconds; the load tester waits for every request. Every second the sampler records each
arm's replicas (every replica Serve holds, starting and stopping ones too: what the lane pays for) and the
L the controller last chose.

Per arm: goodput (completed requests per second that meet both targets, over the run), replica-seconds,
and the share of 10-second windows (by request start) whose TTFT p95 and TPOT p95 are both within the
targets: over all windows, and over those that start `--settle-s` or more after the ramp begins to rise
and after it reaches its peak (the time a replica takes to start on this machine). Writes <out>/results.json,
<out>/README.md and <out>/ramp.png.

    python -m benchmarks.planner_ramp --ceiling 1,2,4 --out benchmarks/results/planner_ramp_cpu

measures instead what the machine serves with that many fixed replicas, each kept full (closed loop, twice
`--max-num-seqs` requests in flight per replica, `--ceiling-s` seconds): requests and output tokens per
second, TTFT and TPOT p95. Writes <out>/ceiling.json.
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import ray
from ray import serve

from deployments.config import DEFAULT_DRAFT, DEFAULT_TARGET, REPO_ROOT
from loadtest.arrivals import ClosedLoop, RampLoop
from loadtest.client import RequestOptions
from loadtest.runner import RunResult, run_load
from loadtest.workload import WorkloadRequest, count_tokens, load_tokenizer
from tests.serve_helpers import base_url, delete, deploy, ray_cluster
from training.corpus import collect_corpus

ARMS = ("planner", "serve-default", "fixed")
LANE = {"num_cpus": 0.05}
# The L controller's block calibrated for the 2-core CPU and the shipped pair (docs/controller.md, "The
# controller's block"): each draft token added 24-35 ms to a 16-row step; L = 2 gave the most tokens per
# second at 16 running requests, so a verify batch holds 16 x (2 + 1) tokens.
DEFAULT_CONTROLLER = {"interval_s": 0.5, "initial_draft_len": 4, "max_draft_len": 8, "draft_cost_ratio": 0.35,
                      "target_decode_p95_ms": 200, "verify_queue_high": 8, "verify_queue_low": 2,
                      "verify_token_budget": 48}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/planner_ramp_cpu")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    parser.add_argument("--base-rps", type=float, default=1.0, help="1x: about one replica's capacity")
    parser.add_argument("--peak-factor", type=float, default=4.0)
    parser.add_argument("--hold-s", type=float, default=30.0)
    parser.add_argument("--ramp-s", type=float, default=60.0)
    parser.add_argument("--peak-s", type=float, default=60.0)
    parser.add_argument("--tail-s", type=float, default=60.0)
    parser.add_argument("--ttft-ms", type=float, default=1500.0, help="slo.ttft_p95_ms")
    parser.add_argument("--tpot-ms", type=float, default=60.0, help="slo.tpot_p95_ms")
    parser.add_argument("--slo", default="{}", help="JSON merged into the planner arm's slo block")
    parser.add_argument("--max-num-seqs", type=int, default=2)
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--fixed-replicas", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=200, help="distinct prompts, cycled")
    parser.add_argument("--controller", default=json.dumps(DEFAULT_CONTROLLER), help="JSON of the L controller's block")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--settle-s", type=float, default=30.0)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ceiling", default=None, help="comma-separated replica counts: measure the machine's "
                        "ceiling with each (fixed replicas kept full) instead of the ramp")
    parser.add_argument("--ceiling-s", type=float, default=30.0)
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


def cpu_sample() -> tuple[float, float, dict[int, float]]:
    """(monotonic s, busy CPU s of the whole machine, CPU s of every process in this benchmark's tree: the
    driver, Ray's daemons and workers, the Serve replicas)."""
    t = psutil.cpu_times()
    busy_s = t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)
    ours = {}
    me = psutil.Process()
    for proc in (me, *me.children(recursive=True)):
        try:
            c = proc.cpu_times()
            ours[proc.pid] = c.user + c.system
        except psutil.Error:
            pass  # exited meanwhile
    return time.monotonic(), busy_s, ours


def foreign_cores(before: tuple, after: tuple) -> float:
    """Mean cores busy with processes outside this benchmark's tree between two `cpu_sample`s."""
    (t0, busy0, ours0), (t1, busy1, ours1) = before, after
    ours_s = sum(s - ours0.get(pid, 0.0) for pid, s in ours1.items())
    return max(0.0, (busy1 - busy0 - ours_s) / (t1 - t0)) if t1 > t0 else 0.0


def ramp(args: argparse.Namespace) -> RampLoop:
    base, peak = args.base_rps, args.base_rps * args.peak_factor
    t = np.cumsum([0, args.hold_s, args.ramp_s, args.peak_s, args.ramp_s])
    return RampLoop(((0.0, base), (float(t[1]), base), (float(t[2]), peak), (float(t[3]), peak),
                     (float(t[4]), base)))


def duration_s(args: argparse.Namespace) -> float:
    return args.hold_s + 2 * args.ramp_s + args.peak_s + args.tail_s


def app_configs(args: argparse.Namespace, fixed_replicas: int | None = None) -> dict[str, dict]:
    """Every arm's app config (`fixed_replicas`: the fixed arm's count, `--fixed-replicas` by default)."""
    controller = json.loads(args.controller)
    base = {"mode": "unified", "target": {"path": args.target}, "draft": {"path": args.draft}, "ingress": LANE,
            "engine": {"max_model_len": 512, "max_num_seqs": args.max_num_seqs, "max_draft_len": 8,
                       "num_speculative_tokens": controller.get("initial_draft_len", 4)},
            "controller": controller}
    slo = {"ttft_p95_ms": args.ttft_ms, "tpot_p95_ms": args.tpot_ms, "max_replicas": args.max_replicas,
           **json.loads(args.slo)}
    arms = {
        "planner": {**base, "decode_lane": {**LANE, "num_replicas": 1}, "slo": slo},
        "serve-default": {**base, "decode_lane": {**LANE, "num_replicas": None, "autoscaling_config": {
            "min_replicas": 1, "max_replicas": args.max_replicas}}},
        "fixed": {**base, "decode_lane": {**LANE, "num_replicas": fixed_replicas or args.fixed_replicas}},
    }
    return arms


def lane_replicas(app: str) -> int:
    """Every DecodeLane replica Serve holds for the app (starting, running, stopping)."""
    deployment = serve.status().applications[app].deployments.get("DecodeLane")
    return sum(deployment.replica_states.values()) if deployment is not None else 0


async def sample(app: str, trace: list[dict], origin_s: float, every_s: float = 1.0) -> None:
    """Every `every_s`: the lane's replicas and the L controller's default L, until cancelled."""
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            replicas = await asyncio.to_thread(lane_replicas, app)
            try:
                state = (await http.get(f"{base_url(app).removesuffix('/v1')}/v1/controller")).json()
            except (httpx.HTTPError, ValueError):
                state = {}
            trace.append({"t_s": round(time.perf_counter() - origin_s, 2), "replicas": replicas,
                          "draft_len": state.get("default_draft_len")})
            await asyncio.sleep(every_s)


async def run_arm(name: str, workload, args) -> tuple[RunResult, list[dict], dict]:
    base = base_url(name).removesuffix("/v1")
    # A few requests first, so that no arm pays for cold caches.
    await run_load(base, workload[:4], RampLoop(((0.0, 1.0),)), progress=False)
    trace: list[dict] = []
    origin_s = time.perf_counter()
    sampler = asyncio.create_task(sample(name, trace, origin_s))
    cpu_before, load_before = cpu_sample(), os.getloadavg()
    try:
        result = await run_load(base, workload, ramp(args), duration_s=duration_s(args),
                                options=RequestOptions(temperature=0.0), seed=args.seed, progress=False)
    finally:
        sampler.cancel()
    machine = {"foreign_cores": round(foreign_cores(cpu_before, cpu_sample()), 2),
               "load_average_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    return result, trace, machine


def p95(values: list[float]) -> float | None:
    return float(np.percentile(values, 95)) if values else None


def windows(result: RunResult, args) -> list[dict]:
    """Per `window_s` of request starts: requests, their TTFT and TPOT p95, and whether both are within target
    (a window with a failed request, or none measured, is not)."""
    out = []
    end_s = duration_s(args)
    for start in np.arange(0.0, end_s, args.window_s):
        records = [r for r in result.records if start <= r.start_s < start + args.window_s]
        ttft = p95([r.ttft_ms for r in records if r.ttft_ms is not None])
        tpot = p95([r.tpot_ms for r in records if r.tpot_ms is not None])
        failed = sum(r.status != "completed" for r in records)
        ok = bool(records) and not failed and ttft is not None and ttft <= args.ttft_ms and \
            (tpot is None or tpot <= args.tpot_ms)
        out.append({"start_s": float(start), "requests": len(records), "failed": failed, "ttft_p95_ms": ttft,
                    "tpot_p95_ms": tpot, "within": ok})
    return out


def settled(window: dict, args) -> bool:
    """Not within `settle_s` of the ramp starting to rise, nor of it reaching its peak."""
    rise, top = args.hold_s, args.hold_s + args.ramp_s
    return not any(t <= window["start_s"] < t + args.settle_s for t in (rise, top))


def replica_seconds(trace: list[dict]) -> float:
    return sum(b["replicas"] * (b["t_s"] - a["t_s"]) for a, b in zip(trace, trace[1:]))


def arm_row(result: RunResult, trace: list[dict], machine: dict, args) -> dict:
    slos = {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms}
    s = result.summary(slos)
    assert s.submitted == s.completed + s.failed + s.timed_out == len(result.records)
    wins = windows(result, args)
    calm = [w for w in wins if settled(w, args)]
    lengths = [p["draft_len"] for p in trace if p["draft_len"] is not None]
    return {
        "submitted": s.submitted, "completed": s.completed, "failed": s.failed, "timed_out": s.timed_out,
        "wall_s": round(s.wall_s, 1), "goodput_rps": round(s.goodput_rps, 3),
        "throughput_rps": round(s.request_throughput_rps, 3),
        "ttft_ms_p95": s.latency_ms["ttft_ms"].p95, "tpot_ms_p95": s.latency_ms["tpot_ms"].p95,
        "replica_seconds": round(replica_seconds(trace), 1), "max_replicas": max(p["replicas"] for p in trace),
        "final_replicas": trace[-1]["replicas"],
        "windows_within": round(sum(w["within"] for w in wins) / len(wins), 3),
        "settled_windows_within": round(sum(w["within"] for w in calm) / len(calm), 3) if calm else None,
        "mean_draft_len": round(statistics.mean(lengths), 2) if lengths else None,
        **machine, "windows": wins, "trace": trace, "summary": s.to_dict(),
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    rate = ax.twinx()
    sched = report["schedule"]
    rate.plot([p[0] for p in sched] + [report["duration_s"]], [p[1] for p in sched] + [sched[-1][1]],
              color="black", alpha=0.3)
    rate.set_ylabel("offered req/s")
    axes[0].legend()
    axes[3].set_xlabel("seconds since the ramp started")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [
        "# Replica planner vs Serve's default policy vs fixed replicas: one load ramp, CPU",
        "",
        f"Command: `{report['command']}` at commit {report['commit']}. Machine: {report['machine']}; load average "
        f"(1 min) at each arm's start and end in the table, CPU cores used by processes outside the benchmark "
        "during each arm as `other cores`.",
        "",
        f"Mode unified, shipped pair, max_num_seqs {a['max_num_seqs']} per replica, {a['prompt_tokens']}-token "
        f"held-out prompts, {a['output_tokens']} output tokens, greedy, the L controller on in every arm. Ramp "
        f"(Poisson arrivals): {a['base_rps']:g} req/s for {a['hold_s']:g} s, up to {a['peak_factor']:g}x over "
        f"{a['ramp_s']:g} s, held {a['peak_s']:g} s, down over {a['ramp_s']:g} s, {a['tail_s']:g} s at 1x. "
        f"Targets: TTFT p95 <= {a['ttft_ms']:g} ms, TPOT p95 <= {a['tpot_ms']:g} ms. Goodput: completed requests "
        f"meeting both, per second of the run. Windows: {a['window_s']:g} s of request starts, within when both "
        f"p95s are and no request failed; settled: windows starting {a['settle_s']:g} s or more after the ramp "
        "starts to rise and after it reaches its peak.",
        "",
        "| arm | goodput (req/s) | completed / submitted | failed | replica-seconds | most / last replicas | "
        "windows within | settled windows within | TTFT p95 (ms) | TPOT p95 (ms) | mean L | load avg | other cores |",
        "|---" * 13 + "|",
    ]
    for name, r in report["arms"].items():
        lines.append(
            f"| {name} | {r['goodput_rps']:.2f} | {r['completed']} / {r['submitted']} | {r['failed'] + r['timed_out']} "
            f"| {r['replica_seconds']:.0f} | {r['max_replicas']} / {r['final_replicas']} | {r['windows_within']:.0%} "
            f"| {_pct(r['settled_windows_within'])} | {_fmt(r['ttft_ms_p95'])} | {_fmt(r['tpot_ms_p95'])} "
            f"| {_fmt(r['mean_draft_len'], '.1f')} | {r['load_average_1m'][0]} -> {r['load_average_1m'][1]} "
            f"| {r['foreign_cores']} |")
    lines += ["", "![replicas, L and latency against time](ramp.png)", ""]
    return "\n".join(lines)


def _fmt(value, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def _pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"


async def full_load(name: str, replicas: int, workload, args) -> dict:
    base = base_url(name).removesuffix("/v1")
    await run_load(base, workload[:4], RampLoop(((0.0, 1.0),)), progress=False)
    cpu_before = cpu_sample()
    result = await run_load(base, workload, ClosedLoop(2 * replicas * args.max_num_seqs),
                            duration_s=args.ceiling_s, options=RequestOptions(temperature=0.0), progress=False)
    s = result.summary({})
    return {"replicas": replicas, "in_flight": 2 * replicas * args.max_num_seqs, "completed": s.completed,
            "failed": s.failed + s.timed_out, "request_rps": round(s.request_throughput_rps, 3),
            "output_tps": round(s.output_token_throughput_tps, 1), "ttft_ms_p95": s.latency_ms["ttft_ms"].p95,
            "tpot_ms_p95": s.latency_ms["tpot_ms"].p95,
            "foreign_cores": round(foreign_cores(cpu_before, cpu_sample()), 2),
            "load_average_1m": round(os.getloadavg()[0], 2)}


def ceiling(args: argparse.Namespace, workload) -> None:
    """What the machine serves with each count of fixed replicas, kept full."""
    rows = []
    for replicas in (int(n) for n in args.ceiling.split(",")):
        name = f"ceiling{replicas}"
        deploy({name: app_configs(args, replicas)["fixed"]})
        try:
            rows.append(asyncio.run(full_load(name, replicas, workload, args)))
        finally:
            delete([name])
        print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m benchmarks.planner_ramp", *sys.argv[1:]])
    (args.out / "ceiling.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workload = heldout_workload(args)
    ray_cluster()
    if args.ceiling:
        return ceiling(args, workload)
    configs = {name: config for name, config in app_configs(args).items() if name in args.arms.split(",")}
    arms = {}
    for name, config in configs.items():
        deploy({name: config})
        try:
            result, trace, machine = asyncio.run(run_arm(name, workload, args))
        finally:
            delete([name])
        arms[name] = arm_row(result, trace, machine, args)
        r = arms[name]
        print(f"{name}: goodput {r['goodput_rps']:.2f} req/s, {r['completed']}/{r['submitted']} completed, "
              f"{r['replica_seconds']:.0f} replica-s, windows within {r['windows_within']:.0%}, "
              f"settled {_pct(r['settled_windows_within'])}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT)
    report = {
        "command": " ".join(["python -m benchmarks.planner_ramp", *(argv or [])]), "commit": commit.stdout.strip(),
        "machine": f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), no GPU, shared",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "schedule": ramp(args).points, "duration_s": duration_s(args), "app_configs": configs, "arms": arms,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "ramp.png")
    (args.out / "README.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main(sys.argv[1:])
