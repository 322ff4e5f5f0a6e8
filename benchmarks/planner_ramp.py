"""The replica planner against Serve's default autoscaling policy and fixed replicas, on one load ramp.

    python -m benchmarks.planner_ramp --out benchmarks/results/planner_ramp_cpu

Deploys the shipped pair (models/vpd-target + models/vpd-draft) in mode unified, one arm at a time (so that
no other arm's replicas share the cores), each with the draft-length controller on (`--controller`, the
CPU-calibrated block DEFAULT_CONTROLLER), every replica small (`--max-num-seqs`) so that the ramp's peak needs
several (defaults per `--device`: see the options):
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

    python -m benchmarks.planner_ramp --device cuda --arms planner --budget-s 540 --out OUT/planner
    python -m benchmarks.planner_ramp --device cuda --arms fixed,serve-default --budget-s 540 --out OUT/others
    python -m benchmarks.planner_ramp --merge OUT/planner,OUT/others --out benchmarks/results/planner_ramp_h100

On one GPU (`--device cuda`): the constructed Llama-2-7B / TinyLlama pair (`--shape`, `--agreement`,
benchmarks/lib/pairs.py) in bfloat16, prompts of random token ids, and every DecodeLane replica a
1 / `--max-replicas` share of the GPU (`num_gpus`; its memory profile sizes its KV pools from that share
of the GPU's memory), so that at most `--max-replicas` replicas fit and Serve places no more; the
planner's bound is that count (deployments/planning.py `gpu_replica_bound`). Ray starts as
benchmarks/lib/cluster.py `start_model_cluster` does (Triton compiled for the GPU). Arms can run in
separate invocations (each writes its own README.md and results.json); `--merge` puts them in one.
`--budget-s` starts no arm that the previous one's wall time says would end after it.
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import ray
from ray import serve

from transformers import AutoConfig

from benchmarks.lib.cluster import deploy as deploy_app
from benchmarks.lib.cluster import free_device_memory, git_commit, machine, start_model_cluster
from benchmarks.lib.engine_runs import random_work
from benchmarks.lib.pairs import save_pair
from deployments.config import DEFAULT_DRAFT, DEFAULT_TARGET, REPO_ROOT
from loadtest.arrivals import ClosedLoop, RampLoop
from loadtest.client import RequestOptions
from loadtest.runner import RunResult, run_load
from loadtest.workload import WorkloadRequest, count_tokens, load_tokenizer
from tests.serve_helpers import HTTP_PORT, delete, deploy, ray_cluster
from training.corpus import collect_corpus

ARMS = ("planner", "serve-default", "fixed")
LANE = {"num_cpus": 0.05}
# The L controller's block calibrated for the 2-core CPU and the shipped pair (docs/controller.md, "The
# controller's block"): each draft token added 24-35 ms to a 16-row step; L = 2 gave the most tokens per
# second at 16 running requests, so a verify batch holds 16 x (2 + 1) tokens.
DEFAULT_CONTROLLER = {"interval_s": 0.5, "initial_draft_len": 4, "max_draft_len": 8, "draft_cost_ratio": 0.35,
                      "target_decode_p95_ms": 200, "verify_queue_high": 8, "verify_queue_low": 2,
                      "verify_token_budget": 48}
# On the GPU the controller's own (GPU) defaults, from L = 3 (the best single-stream L of the constructed pair
# at agreement 0.8, benchmarks/lib/apps.py), never below 1.
GPU_CONTROLLER = {"interval_s": 0.5, "initial_draft_len": 3, "max_draft_len": 8, "min_draft_len": 1}
# Defaults per device. cuda: the constructed 7B pair on one H100, 1 / max_replicas of it per replica. A
# replica of max_num_seqs 4 alone serves about 4 x 260 tok/s (spec at one stream: 10.4 ms steps, 3.9 ms
# TPOT, benchmarks/results/stream_latency_h100) = 7-8 requests of 128 tokens a second; replicas on one GPU
# share its memory bandwidth, so 1x = 5 req/s is about 0.65 of one replica and the 20 req/s peak asks for
# 3-4 of them. Targets: TTFT p95 1 s (a 128-token prefill takes tens of ms: the rest is waiting for a slot),
# TPOT p95 40 ms (3-10x the 4-13 ms TPOT of a replica alone: room for four replicas time-sharing the GPU).
# The ramp is short (130 s of arrivals) so that two arms fit one 9.5-minute device call: a replica takes
# 40-60 s to load the 7B pair and capture its CUDA graphs, and an overloaded arm drains for up to the
# request timeout (30 s; past the ingress's 256 queued requests new ones are refused at once).
DEVICE_DEFAULTS = {
    "cpu": {"base_rps": 1.0, "hold_s": 30.0, "ramp_s": 60.0, "peak_s": 60.0, "tail_s": 60.0, "ttft_ms": 1500.0,
            "tpot_ms": 60.0, "max_num_seqs": 2, "prompt_tokens": 64, "output_tokens": 32,
            "controller": json.dumps(DEFAULT_CONTROLLER), "request_timeout_s": 300.0},
    "cuda": {"base_rps": 5.0, "hold_s": 15.0, "ramp_s": 25.0, "peak_s": 40.0, "tail_s": 25.0, "ttft_ms": 1000.0,
             "tpot_ms": 40.0, "max_num_seqs": 4, "prompt_tokens": 128, "output_tokens": 128,
             "controller": json.dumps(GPU_CONTROLLER), "request_timeout_s": 30.0},
}
DEPLOY_TIMEOUT_S = 300.0  # cuda: a replica loads 15 GiB of weights and captures its graphs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/planner_ramp_cpu")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    parser.add_argument("--device", choices=tuple(DEVICE_DEFAULTS), default="cpu")

    def per_device(flag: str, kind=float, note: str = "") -> None:
        key = flag.removeprefix("--").replace("-", "_")
        cpu, cuda = DEVICE_DEFAULTS["cpu"][key], DEVICE_DEFAULTS["cuda"][key]
        text = f"{note + '; ' if note else ''}default {cpu} on cpu, {cuda} on cuda"
        parser.add_argument(flag, type=kind, default=None, help=text.replace("%", "%%"))

    per_device("--base-rps", note="1x: about one replica's capacity")
    parser.add_argument("--peak-factor", type=float, default=4.0)
    for flag in ("--hold-s", "--ramp-s", "--peak-s", "--tail-s"):
        per_device(flag)
    per_device("--ttft-ms", note="slo.ttft_p95_ms")
    per_device("--tpot-ms", note="slo.tpot_p95_ms")
    parser.add_argument("--slo", default="{}", help="JSON merged into the planner arm's slo block")
    per_device("--max-num-seqs", int)
    parser.add_argument("--max-replicas", type=int, default=4, help="on cuda also 1 / a replica's share of the GPU")
    parser.add_argument("--fixed-replicas", type=int, default=1)
    per_device("--prompt-tokens", int)
    per_device("--output-tokens", int)
    parser.add_argument("--num-prompts", type=int, default=200, help="distinct prompts, cycled")
    per_device("--controller", str, note="JSON of the L controller's block")
    per_device("--request-timeout-s", note="the load tester's limit on one request")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--settle-s", type=float, default=30.0)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ceiling", default=None, help="comma-separated replica counts: measure the machine's "
                        "ceiling with each (fixed replicas kept full) instead of the ramp")
    parser.add_argument("--ceiling-s", type=float, default=30.0)
    parser.add_argument("--shape", default="tinyllama-7b", help="cuda: the constructed pair's shape")
    parser.add_argument("--agreement", type=float, default=0.8, help="cuda: the constructed pair's agreement")
    parser.add_argument("--pair-dir", type=Path, default=Path("/tmp/vpd_gpu_modes"), help="cuda: where the pair is saved")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.95, help="cuda: engine.gpu_memory_utilization "
                        "(of a replica's share of the GPU's memory)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no arm that, by the previous arm's wall "
                        "time, would end more than this many seconds after the start")
    parser.add_argument("--merge", default=None, help="comma-separated result folders of earlier runs: one README, "
                        "results.json and ramp.png of all their arms under --out; nothing is run")
    args = parser.parse_args(argv)
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


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


def random_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    """`num_prompts` prompts of `prompt_tokens` random token ids (the constructed pair has no text to draw
    them from), as the GPU benchmarks send them (benchmarks/lib/engine_runs.py)."""
    vocab = AutoConfig.from_pretrained(args.target).get_text_config().vocab_size
    return random_work(vocab, args.prompt_tokens, args.output_tokens, 1, args.num_prompts, args.seed).workload()


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
    lane = LANE
    if args.device == "cuda":
        # A replica's share of the GPU: Serve places at most max_replicas, and each sizes its KV pools from
        # gpu_memory_utilization x that share of the GPU's memory (deployments/factories.py).
        lane = {"num_cpus": 1.0, "num_gpus": 1 / args.max_replicas}
        for role in ("target", "draft"):
            base[role]["dtype"] = "bfloat16"
        base["engine"].update(max_model_len=args.prompt_tokens + args.output_tokens + 64,
                              gpu_memory_utilization=args.gpu_memory_utilization)
    slo = {"ttft_p95_ms": args.ttft_ms, "tpot_p95_ms": args.tpot_ms, "max_replicas": args.max_replicas,
           **json.loads(args.slo)}
    arms = {
        "planner": {**base, "decode_lane": {**lane, "num_replicas": 1}, "slo": slo},
        "serve-default": {**base, "decode_lane": {**lane, "num_replicas": None, "autoscaling_config": {
            "min_replicas": 1, "max_replicas": args.max_replicas}}},
        "fixed": {**base, "decode_lane": {**lane, "num_replicas": fixed_replicas or args.fixed_replicas}},
    }
    return arms


def lane_replicas(app: str) -> int:
    """Every DecodeLane replica Serve holds for the app (starting, running, stopping)."""
    deployment = serve.status().applications[app].deployments.get("DecodeLane")
    return sum(deployment.replica_states.values()) if deployment is not None else 0


def start_cluster(args: argparse.Namespace) -> str:
    """Ray and Serve for the arms; returns the URL the apps are served under (each at /<arm>). On cuda
    as benchmarks/lib/cluster.py starts one for apps of large models (Triton compiled for the GPU)."""
    if args.device == "cuda":
        return f"http://127.0.0.1:{start_model_cluster()}"
    ray_cluster()
    return f"http://127.0.0.1:{HTTP_PORT}"


def deploy_arm(name: str, config: dict, args: argparse.Namespace) -> None:
    if args.device == "cuda":
        deploy_app(name, config, timeout_s=DEPLOY_TIMEOUT_S)  # until Serve says RUNNING
    else:
        deploy({name: config})  # until it answers /health


def delete_arm(name: str, args: argparse.Namespace) -> None:
    if args.device == "cuda":
        serve.delete(name)  # waits until its replicas have stopped and given the GPU back
        free_device_memory()
    else:
        delete([name])


async def sample(app: str, url: str, trace: list[dict], origin_s: float, every_s: float = 1.0) -> None:
    """Every `every_s`: the lane's replicas and the L controller's default L, until cancelled."""
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            replicas = await asyncio.to_thread(lane_replicas, app)
            try:
                state = (await http.get(f"{url}/v1/controller")).json()
            except (httpx.HTTPError, ValueError):
                state = {}
            trace.append({"t_s": round(time.perf_counter() - origin_s, 2), "replicas": replicas,
                          "draft_len": state.get("default_draft_len")})
            await asyncio.sleep(every_s)


async def run_arm(name: str, base: str, workload, args) -> tuple[RunResult, list[dict], dict]:
    """The ramp against the app at `base` (its URL), with the sampler beside it."""
    # A few requests first, so that no arm pays for cold caches.
    await run_load(base, workload[:4], RampLoop(((0.0, 1.0),)), timeout_s=args.request_timeout_s, progress=False)
    trace: list[dict] = []
    origin_s = time.perf_counter()
    sampler = asyncio.create_task(sample(name, base, trace, origin_s))
    cpu_before, load_before = cpu_sample(), os.getloadavg()
    try:
        result = await run_load(base, workload, ramp(args), duration_s=duration_s(args),
                                options=RequestOptions(temperature=0.0), timeout_s=args.request_timeout_s,
                                seed=args.seed, progress=False)
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
    cuda = a.get("device") == "cuda"
    setting = (f"constructed {a['shape']} pair (agreement {a['agreement']:g}, bfloat16), each replica "
               f"1/{a['max_replicas']} of the GPU (num_gpus {1 / a['max_replicas']:.3g}, engine.gpu_memory_utilization "
               f"{a['gpu_memory_utilization']:g} of that share), max_num_seqs {a['max_num_seqs']} per replica, "
               f"{a['prompt_tokens']}-token random-id prompts" if cuda else
               f"shipped pair, max_num_seqs {a['max_num_seqs']} per replica, {a['prompt_tokens']}-token held-out prompts")
    lines = [
        f"# Replica planner vs Serve's default policy vs fixed replicas: one load ramp, {'one GPU' if cuda else 'CPU'}",
        "",
        f"Command: `{report['command']}` at commit {report['commit']}. Machine: {report['machine']}; load average "
        f"(1 min) at each arm's start and end in the table, CPU cores used by processes outside the benchmark "
        "during each arm as `other cores`.",
        "",
        f"Mode unified, {setting}, {a['output_tokens']} output tokens, greedy, the L controller on in every arm. Ramp "
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
    if report.get("errors"):
        lines += ["## Arms not measured", ""] + [f"- {name}: {why}" for name, why in report["errors"].items()] + [""]
    return "\n".join(lines)


def _fmt(value, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def _pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"


async def full_load(base: str, replicas: int, workload, args) -> dict:
    await run_load(base, workload[:4], RampLoop(((0.0, 1.0),)), timeout_s=args.request_timeout_s, progress=False)
    cpu_before = cpu_sample()
    result = await run_load(base, workload, ClosedLoop(2 * replicas * args.max_num_seqs),
                            duration_s=args.ceiling_s, options=RequestOptions(temperature=0.0),
                            timeout_s=args.request_timeout_s, progress=False)
    s = result.summary({})
    return {"replicas": replicas, "in_flight": 2 * replicas * args.max_num_seqs, "completed": s.completed,
            "failed": s.failed + s.timed_out, "request_rps": round(s.request_throughput_rps, 3),
            "output_tps": round(s.output_token_throughput_tps, 1), "ttft_ms_p95": s.latency_ms["ttft_ms"].p95,
            "tpot_ms_p95": s.latency_ms["tpot_ms"].p95,
            "foreign_cores": round(foreign_cores(cpu_before, cpu_sample()), 2),
            "load_average_1m": round(os.getloadavg()[0], 2)}


def ceiling(args: argparse.Namespace, url: str, workload) -> None:
    """What the machine serves with each count of fixed replicas, kept full."""
    rows = []
    for replicas in (int(n) for n in args.ceiling.split(",")):
        name = f"ceiling{replicas}"
        deploy_arm(name, app_configs(args, replicas)["fixed"], args)
        try:
            rows.append(asyncio.run(full_load(f"{url}/{name}", replicas, workload, args)))
        finally:
            delete_arm(name, args)
        print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m benchmarks.planner_ramp", *sys.argv[1:]])
    (args.out / "ceiling.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))


def machine_line(args: argparse.Namespace) -> str:
    if args.device == "cuda":
        m = machine()
        return f"one {m['gpu']}, {m['cpu_cores']} CPU cores ({m['cpu_model']})"
    return f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), no GPU, shared"


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    if report["arms"]:
        plot(report, out / "ramp.png")
    (out / "README.md").write_text(markdown(report))


# Arguments that may differ between runs that `--merge` puts in one report.
MERGE_FREE = {"arms", "out", "budget_s", "merge"}


def merge(args: argparse.Namespace) -> None:
    """One report of the arms of several runs (each its own invocation) of the same settings."""
    reports = [json.loads((Path(d) / "results.json").read_text()) for d in args.merge.split(",")]
    first = reports[0]
    for other in reports[1:]:
        differ = {k for k in first["args"].keys() | other["args"].keys()
                  if k not in MERGE_FREE and first["args"].get(k) != other["args"].get(k)}
        if differ:
            raise SystemExit(f"--merge: the runs differ in {sorted(differ)}: their arms are not comparable")
    report = {**first, "command": "; ".join(r["command"] for r in reports),
              "commit": ", ".join(dict.fromkeys(r["commit"] for r in reports)),
              "machine": "; ".join(dict.fromkeys(r["machine"] for r in reports)),
              "app_configs": {k: v for r in reports for k, v in r["app_configs"].items()},
              "arms": {k: v for r in reports for k, v in r["arms"].items()},
              "errors": {k: v for r in reports for k, v in r.get("errors", {}).items()}}
    write_report(report, args.out)
    print(markdown(report))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    started_s = time.monotonic()
    if args.device == "cuda":
        pair = save_pair(args.shape, args.agreement, args.pair_dir, dtype="bfloat16", device="cuda")
        args.target, args.draft = str(pair.target), str(pair.draft)
        workload = random_workload(args)
    else:
        workload = heldout_workload(args)
    url = start_cluster(args)
    if args.ceiling:
        return ceiling(args, url, workload)
    every = app_configs(args)
    configs = {name: every[name] for name in args.arms.split(",")}  # in the order asked for
    report = {
        "command": " ".join(["python -m benchmarks.planner_ramp", *(argv or [])]), "commit": git_commit(),
        "machine": machine_line(args),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "schedule": ramp(args).points, "duration_s": duration_s(args), "app_configs": configs, "arms": {},
        "errors": {},
    }
    last_arm_s = 0.0
    for name, config in configs.items():
        if args.budget_s is not None and time.monotonic() - started_s + last_arm_s > args.budget_s:
            report["errors"][name] = (f"skipped: {time.monotonic() - started_s:.0f} s spent, and the previous arm "
                                      f"took {last_arm_s:.0f} s, of --budget-s {args.budget_s:g}")
            print(f"{name}: {report['errors'][name]}", flush=True)
            continue
        arm_started_s = time.monotonic()
        try:
            deploy_arm(name, config, args)
            try:
                result, trace, machine_load = asyncio.run(run_arm(name, f"{url}/{name}", workload, args))
            finally:
                delete_arm(name, args)
        except Exception as exc:  # one arm failing leaves the others measured
            report["errors"][name] = repr(exc)
            print(f"{name}: failed: {exc!r}", flush=True)
            continue
        finally:
            last_arm_s = time.monotonic() - arm_started_s
        report["arms"][name] = r = arm_row(result, trace, machine_load, args)
        print(f"{name}: goodput {r['goodput_rps']:.2f} req/s, {r['completed']}/{r['submitted']} completed, "
              f"{r['replica_seconds']:.0f} replica-s, windows within {r['windows_within']:.0%}, "
              f"settled {_pct(r['settled_windows_within'])}, arm {last_arm_s:.0f} s", flush=True)
        write_report(report, args.out)  # after every arm: a run cut short keeps what it measured
    write_report(report, args.out)
    print(markdown(report))
    if args.device == "cuda":
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
