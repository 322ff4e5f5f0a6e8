"""Goodput across a load ramp: the draft-length controller against fixed draft lengths L.

    python -m benchmarks.controller_ramp --out benchmarks/results/controller_ramp_cpu

Deploys one app per arm on a draft/target pair (by default the shipped models/vpd-target + models/vpd-draft;
`--target`, `--draft` and `--device cuda` for another pair on a GPU), all in mode unified:
"L0", "L2", "L4", "L8" (controller off, num_speculative_tokens = L) and "controller" (controller on,
starting at L = 4, lowest L 2); `--arms` may add "controller-min0", the same controller allowed to turn
speculation off (min_draft_len 0). Then drives each arm, one after the other, through the whole ramp: for
every rate, `--step-duration-s` seconds of open-loop (Poisson) arrivals with the load tester
(loadtest.runner.run_load), which waits for every request in flight to end before the next rate starts.
An arm's steps follow each other without a pause, so a controller meets the ramp as one rising load, with
its state carried from step to step. Every arm gets the same seeded arrival times at a given rate.

The machine may be shared, so the whole sequence runs `--passes` times with the arms' order rotated from
pass to pass, and every step records the CPU that processes outside this benchmark's process tree used
meanwhile (`foreign_cores`, mean cores) and the 1-minute load average. Each arm's ramp starts once other
processes use at most `--disturbed-cores` cores over 2 s (waiting at most `--quiet-wait-s`). A step during
which they used more counts as disturbed. Goodput is reported per pass, as the median and the mean over
passes, and as the median over the quiet (undisturbed) passes of each arm and rate: the headline, since
the same rule drops disturbed steps of every arm. `--max-reruns` (default 0) runs a disturbed ramp again
instead; with a cap on reruns in all, the arms that run first use them up, so it is off by default.

Prompts are windows of the held-out part of the training corpus (Python source the pair never saw),
decoded greedily, the setting in which models/pair_metrics.json measured the pair's acceptance.

Writes <out>.json (every summary, the controllers' decisions sampled during their runs) and <out>.md.
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
import psutil
import ray
from ray import serve

from deployments.config import DEFAULT_DRAFT, DEFAULT_TARGET, REPO_ROOT
from loadtest.arrivals import OpenLoop
from loadtest.client import RequestOptions
from loadtest.runner import RunResult, run_load
from loadtest.summary import parse_slos
from loadtest.workload import WorkloadRequest, count_tokens, load_tokenizer
from tests.serve_helpers import base_url, deploy, ray_cluster
from training.corpus import collect_corpus

FIXED_LENGTHS = (0, 2, 4, 8)
# Controller arms: name -> the lowest L it may set (everything else from --controller).
CONTROLLER_ARMS = {"controller": 2, "controller-min0": 0}
# Within this fraction either side of the best fixed L counts as matching it (a chosen threshold, not a
# measured noise level: the ratio itself is reported next to the outcome).
MATCH_TOLERANCE = 0.05
# About twice the p95 TPOT of L = 0 at 1 request/s in calibration on this machine (25 ms), and a TTFT a
# user waits.
DEFAULT_SLOS = ["ttft_ms=2000", "tpot_ms=60"]
DEFAULT_CONTROLLER = {
    "interval_s": 0.5, "initial_draft_len": 4, "max_draft_len": 8,
    # Calibration on this machine at 16 running requests, a step estimated as p95 TPOT x tokens per verify
    # step: 85 ms at L = 0; 132, 199, 366 ms at L = 2, 4, 8, so each draft token added 24-35 ms (c = 0.3-0.4).
    "draft_cost_ratio": 0.35,
    # The TPOT SLO (60 ms) times ~3.7 tokens per step at L = 4, rounded down: steps slower than this
    # mean the lanes are past the load at which the SLO holds.
    "target_decode_p95_ms": 200,
    "verify_queue_high": 8, "verify_queue_low": 2,
    # The same calibration: at 16 running requests L = 2 gave each request the most tokens per second
    # (2.57 / 132 ms against 3.68 / 199 at L = 4 and 5.15 / 366 at L = 8, whose TPOT broke the SLO), so a
    # verify batch holds 16 x (2 + 1) tokens before longer drafts cost more than they yield.
    "verify_token_budget": 48,
}
LANE = {"num_cpus": 0.05}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/controller_ramp_cpu",
                        help="path without suffix: writes <out>.json and <out>.md")
    parser.add_argument("--rates", default="1,4,6,8", help="ramp steps, requests per second")
    parser.add_argument("--step-duration-s", type=float, default=10.0, help="seconds of arrivals per step and arm")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=200, help="distinct prompts, cycled")
    parser.add_argument("--slo", action="append", default=None, help="NAME=MS, repeatable (default "
                        f"{' '.join(DEFAULT_SLOS)}); goodput counts completed requests meeting all of them")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--controller", default=json.dumps(DEFAULT_CONTROLLER),
                        help="JSON of the controller arms' controller block")
    all_arms = [*CONTROLLER_ARMS, *(f"L{n}" for n in FIXED_LENGTHS)]
    parser.add_argument("--arms", default=",".join(a for a in all_arms if a != "controller-min0"),
                        help=f"comma-separated, of: {', '.join(all_arms)}")
    parser.add_argument("--passes", type=int, default=3, help="times each arm runs the whole ramp")
    parser.add_argument("--disturbed-cores", type=float, default=0.5, help="a step during which other processes "
                        "used more than this many cores (mean) is disturbed")
    parser.add_argument("--max-reruns", type=int, default=0, help="reruns of disturbed ramps, in all")
    parser.add_argument("--quiet-wait-s", type=float, default=20.0,
                        help="longest wait for other processes to quieten before an arm's ramp")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model directory (HF format, with tokenizer)")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model directory")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the decode lane (the whole engine in mode unified) gets one GPU")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.slo = parse_slos(args.slo or DEFAULT_SLOS)
    return args


def app_configs(args: argparse.Namespace) -> dict[str, dict]:
    decode_lane = {**LANE, "num_gpus": 1} if args.device == "cuda" else LANE
    base = {
        "mode": "unified", "target": {"path": args.target}, "draft": {"path": args.draft},
        "ingress": LANE, "decode_lane": decode_lane,
        "engine": {"max_model_len": 512, "max_num_seqs": args.max_num_seqs, "max_draft_len": 8},
    }
    arms = {f"L{n}": {**base, "engine": {**base["engine"], "num_speculative_tokens": n}} for n in FIXED_LENGTHS}
    controller = json.loads(args.controller)
    for name, min_len in CONTROLLER_ARMS.items():
        arms[name] = {**base, "engine": {**base["engine"], "num_speculative_tokens": controller["initial_draft_len"]},
                      "controller": {**controller, "min_draft_len": min_len}}
    return {name: arms[name] for name in args.arms.split(",")}


def heldout_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    """`num_prompts` windows of `prompt_tokens` tokens spread evenly over the held-out source files."""
    tokenizer = load_tokenizer(args.target)
    heldout = collect_corpus(include_site_packages=False).heldout
    stream = [t for f in heldout for t in tokenizer.encode(f.text, add_special_tokens=False)]
    step = (len(stream) - args.prompt_tokens) // args.num_prompts
    prompts = [tokenizer.decode(stream[i * step : i * step + args.prompt_tokens]) for i in range(args.num_prompts)]
    return [WorkloadRequest(prompt=p, prompt_len=count_tokens(tokenizer, p), output_len=args.output_tokens)
            for p in prompts]


TRACED_SIGNALS = ("verify_queue_depth", "requests_per_verify_batch", "decode_step_p95_ms", "arrival_rate_rps")


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


async def sample_controller(url: str, trace: list[dict], every_s: float = 0.5) -> None:
    """Append the controller's last decision to `trace` every `every_s` until cancelled."""
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            state = (await http.get(url)).json()
            signals = state.get("signals") or {}
            trace.append({"t_s": round(time.monotonic() - start, 2), "decision_index": state.get("decision_index"),
                          "default_draft_len": state.get("default_draft_len"),
                          "draft_len_cap": state.get("draft_len_cap"),
                          "load": state.get("load"), "fleet_accept_rate": state.get("fleet_accept_rate"),
                          **{k: signals.get(k) for k in TRACED_SIGNALS}})
            await asyncio.sleep(every_s)


async def run_arm(name: str, rate_rps: float, workload: list[WorkloadRequest], args) -> tuple[RunResult, list[dict]]:
    base = base_url(name).removesuffix("/v1")
    trace: list[dict] = []
    sampler = None
    if name in CONTROLLER_ARMS:
        sampler = asyncio.create_task(sample_controller(f"{base}/v1/controller", trace))
    cpu_before = cpu_sample()
    try:
        result = await run_load(base, workload, OpenLoop(rate_rps), duration_s=args.step_duration_s,
                                options=RequestOptions(temperature=0.0), seed=args.seed, progress=False)
    finally:
        if sampler is not None:
            sampler.cancel()
    machine = {"foreign_cores": round(foreign_cores(cpu_before, cpu_sample()), 3),
               "load_average_1m": round(os.getloadavg()[0], 2)}
    return result, trace, machine


def arm_row(result: RunResult, trace: list[dict], machine: dict, slos: dict[str, float]) -> dict:
    s = result.summary(slos)
    assert s.submitted == s.completed + s.failed + s.timed_out == len(result.records)
    spec = s.spec_decode
    row = {
        "submitted": s.submitted, "completed": s.completed, "failed": s.failed, "timed_out": s.timed_out,
        "wall_s": round(s.wall_s, 2), "goodput_rps": s.goodput_rps, "throughput_rps": s.request_throughput_rps,
        "output_tps": s.output_token_throughput_tps,
        "ttft_ms_p95": s.latency_ms["ttft_ms"].p95, "tpot_ms_p50": s.latency_ms["tpot_ms"].p50,
        "tpot_ms_p95": s.latency_ms["tpot_ms"].p95,
        # Mean L of the verify steps that carried a draft, and the tokens those steps yielded.
        "mean_draft_len": spec.num_draft_tokens / spec.num_drafts if spec and spec.num_drafts else 0.0,
        "acceptance_rate": spec.acceptance_rate if spec else None,
        "mean_acceptance_length": spec.mean_acceptance_length if spec else None,
        **machine,
        "summary": s.to_dict(),
    }
    if trace:
        row["controller_trace"] = trace
    return row


def verdict(step: dict, arm: str, stat: str) -> dict:
    """The controller arm against the best fixed L on one statistic over passes ("quiet_median", "median"
    or "mean")."""
    fixed = {n: r[f"goodput_rps_{stat}"] for n, r in step["arms"].items() if n not in CONTROLLER_ARMS}
    best = max(fixed, key=fixed.get)
    ours = step["arms"][arm][f"goodput_rps_{stat}"]
    if fixed[best] == 0:
        return {"best_fixed": best, "best_fixed_goodput_rps": 0.0, "controller_goodput_rps": ours, "ratio": None,
                "outcome": "beats" if ours > 0 else "matches"}
    ratio = ours / fixed[best]
    outcome = "beats" if ratio > 1 + MATCH_TOLERANCE else "matches" if ratio >= 1 - MATCH_TOLERANCE else "below"
    return {"best_fixed": best, "best_fixed_goodput_rps": fixed[best], "controller_goodput_rps": ours,
            "ratio": ratio, "outcome": outcome}


def pass_order(arms: list[str], p: int, passes: int) -> list[str]:
    """Pass p runs the arms rotated by p * len / passes: every arm meets the machine early, midway and late."""
    shift = p * len(arms) // passes
    return arms[shift:] + arms[:shift]


async def wait_for_quiet(max_cores: float, max_wait_s: float, window_s: float = 2.0) -> float:
    """Wait until other processes used at most `max_cores` over `window_s`, or `max_wait_s` passed; the
    seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < max_wait_s:
        before = cpu_sample()
        await asyncio.sleep(window_s)
        if foreign_cores(before, cpu_sample()) <= max_cores:
            break
    return time.monotonic() - start


async def arm_ramp(name: str, rates: list[float], workload: list[WorkloadRequest], args) -> list[dict]:
    waited_s = await wait_for_quiet(args.disturbed_cores, args.quiet_wait_s)
    # A few requests first, so that no arm pays for cold caches in its first step.
    await run_load(base_url(name).removesuffix("/v1"), workload[:8], OpenLoop(2.0), progress=False)
    rows = []
    for rate in rates:
        result, trace, machine = await run_arm(name, rate, workload, args)
        rows.append(arm_row(result, trace, machine, args.slo) | {"waited_for_quiet_s": round(waited_s, 1)})
    return rows


async def ramp(args: argparse.Namespace, arms: list[str], workload: list[WorkloadRequest]) -> tuple[list, list]:
    """Every arm through the ramp `passes` times; (steps with per-arm results, discarded disturbed ramps)."""
    rates = [float(r) for r in args.rates.split(",")]
    runs: dict[tuple[float, str], list[dict]] = {(rate, name): [] for rate in rates for name in arms}
    discarded, reruns_left = [], args.max_reruns
    for p in range(args.passes):
        for name in pass_order(arms, p, args.passes):
            while True:
                rows = await arm_ramp(name, rates, workload, args)
                for rate, row in zip(rates, rows):
                    print(f"pass {p}  {name:16s} rate {rate:g} rps  goodput {row['goodput_rps']:.2f} rps  "
                          f"mean L {row['mean_draft_len']:.2f}  other processes {row['foreign_cores']:.2f} cores  "
                          f"load {row['load_average_1m']:.1f}", flush=True)
                disturbed = max(r["foreign_cores"] for r in rows) > args.disturbed_cores
                if not (disturbed and reruns_left > 0):
                    break
                reruns_left -= 1
                discarded.append({"pass": p, "arm": name, "rows": dict(zip(map(str, rates), rows))})
                print(f"pass {p}  {name}: disturbed (other processes > {args.disturbed_cores} cores), again", flush=True)
            for rate, row in zip(rates, rows):
                row["pass"] = p
                runs[rate, name].append(row)
    steps = []
    for rate in rates:
        step = {"rate_rps": rate, "arms": {name: combine(runs[rate, name], args.disturbed_cores) for name in arms}}
        if any(a not in CONTROLLER_ARMS for a in arms):
            controllers = [a for a in arms if a in CONTROLLER_ARMS]
            step["verdicts"] = {a: verdict(step, a, "quiet_median") for a in controllers}
            step["verdicts_all_median"] = {a: verdict(step, a, "median") for a in controllers}
            step["verdicts_mean"] = {a: verdict(step, a, "mean") for a in controllers}
            step["per_pass_ratios"] = {a: per_pass_ratios(step, a) for a in controllers}
        steps.append(step)
    return steps, discarded


def per_pass_ratios(step: dict, arm: str) -> list[float | None]:
    """Controller / best fixed L within each pass (the arms of one pass ran within minutes of each other)."""
    ratios = []
    fixed = [r for n, r in step["arms"].items() if n not in CONTROLLER_ARMS]
    for p, ours in enumerate(step["arms"][arm]["passes"]):
        best = max(r["passes"][p]["goodput_rps"] for r in fixed)
        ratios.append(ours["goodput_rps"] / best if best > 0 else None)
    return ratios


def combine(passes: list[dict], disturbed_cores: float) -> dict:
    """One arm at one rate over all passes: median, mean and range of goodput, the median over quiet passes
    (all passes when none was quiet), mean L, every pass kept."""
    goodput = [r["goodput_rps"] for r in passes]
    quiet = [r["goodput_rps"] for r in passes if r["foreign_cores"] <= disturbed_cores]
    return {"goodput_rps_quiet_median": statistics.median(quiet or goodput), "num_quiet_passes": len(quiet),
            "goodput_rps_median": statistics.median(goodput), "goodput_rps_mean": statistics.mean(goodput),
            "goodput_rps_min": min(goodput), "goodput_rps_max": max(goodput),
            "mean_draft_len": statistics.mean(r["mean_draft_len"] for r in passes),
            "submitted": sum(r["submitted"] for r in passes), "completed": sum(r["completed"] for r in passes),
            "passes": passes}


def pair_card(args: argparse.Namespace) -> dict:
    if (args.target, args.draft) != (DEFAULT_TARGET, DEFAULT_DRAFT):
        # Another pair: its acceptance is the one this run measures (the fixed arms' table rows).
        return {"target": args.target, "draft": args.draft, "greedy_acceptance_per_drafted_token": {},
                "source": "measured in this run"}
    metrics = json.loads((REPO_ROOT / "models/pair_metrics.json").read_text())
    return {"target": "models/vpd-target", "draft": "models/vpd-draft",
            "greedy_acceptance_per_drafted_token": {L: m["acceptance_per_drafted_token"]
                                                    for L, m in metrics["greedy"].items()},
            "greedy_mean_tokens_per_verify_step": {L: m["mean_tokens_per_verify_step"]
                                                   for L, m in metrics["greedy"].items()},
            "source": "models/pair_metrics.json"}


def markdown(report: dict) -> str:
    arms = report["arms"]
    controllers = [a for a in arms if a in CONTROLLER_ARMS]
    slos = ", ".join(f"{k} <= {v:g}" for k, v in report["slos"].items())
    pair = report["pair"]
    accept = ", ".join(f"L={L}: {a:.3f}" for L, a in pair["greedy_acceptance_per_drafted_token"].items())
    accept = f"greedy acceptance per drafted token ({pair['source']}): {accept}" if accept else pair["source"]
    m = report["machine_load"]
    lines = [
        "# Controller vs fixed draft length: goodput across a load ramp",
        "",
        f"Machine: {report['machine']}; load average (1, 5, 15 min) {m['start']} at the start, {m['end']} at "
        f"the end. Pair: {pair['target']} + {pair['draft']}, {accept}.",
        "",
        f"Mode unified (one replica, max_num_seqs {report['args']['max_num_seqs']}), held-out Python prompts of "
        f"{report['args']['prompt_tokens']} tokens, {report['args']['output_tokens']} output tokens, temperature 0, "
        f"Poisson arrivals, {report['args']['step_duration_s']:g} s of arrivals per step and arm. Goodput: "
        f"completed requests meeting {slos}, per second. Controller block: `{report['args']['controller']}`, "
        f"min_draft_len per arm: {', '.join(f'{a} {CONTROLLER_ARMS[a]}' for a in controllers)}. "
        f"Command: `{report['command']}`.",
        "",
        f"Goodput (requests/s), median over the quiet passes of each arm and rate, i.e. those during which other "
        f"processes used at most {report['args']['disturbed_cores']:g} cores (all passes where none was); then "
        f"every one of the {report['args']['passes']} passes in pass order, * marking a disturbed one. "
        f"Controller / best fixed L on the quiet medians (the verdict), on the medians of all passes and on "
        f"their means, 'matches' meaning within ±{MATCH_TOLERANCE:.0%}:",
        "",
        "| rate (req/s) | " + " | ".join(arms) + " | best fixed (quiet) | "
        + " | ".join(f"{a} / best: quiet; all, median; all, mean" for a in controllers) + " |",
        "|---" * (len(arms) + 2 + len(controllers)) + "|",
    ]
    for step in report["steps"]:
        verdicts = step.get("verdicts", {})
        cells = [_goodput_cell(step["arms"][a], report["args"]["disturbed_cores"]) for a in arms]
        best = next(iter(verdicts.values()), {}).get("best_fixed", "")
        ratios = [f"**{_fmt(v['ratio'], '.2f')} ({v['outcome']})**; {_fmt(step['verdicts_all_median'][a]['ratio'], '.2f')}; "
                  f"{_fmt(step['verdicts_mean'][a]['ratio'], '.2f')}" for a, v in verdicts.items()]
        lines.append(f"| {step['rate_rps']:g} | " + " | ".join(cells + [best] + ratios) + " |")
    if controllers and "per_pass_ratios" in report["steps"][0]:
        lines += ["", "Controller / best fixed L within each pass (the best of four noisy arms, so biased against the "
                  "controller; a pass's arms ran within a few minutes of each other):", "",
                  "| rate (req/s) | " + " | ".join(controllers) + " |", "|---" * (len(controllers) + 1) + "|"]
        for step in report["steps"]:
            cells = [", ".join(_fmt(r, ".2f") for r in step["per_pass_ratios"][a]) for a in controllers]
            lines.append(f"| {step['rate_rps']:g} | " + " | ".join(cells) + " |")
    lines += ["", "Mean L of speculated verify steps; p95 TPOT ms and p95 TTFT ms per pass; completed of "
              "submitted, all passes; CPU cores used by other processes during the step, per pass:", "",
              "| rate (req/s) | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for step in report["steps"]:
        cells = [f"L {r['mean_draft_len']:.1f}; TPOT {', '.join(_fmt(p['tpot_ms_p95']) for p in r['passes'])}; "
                 f"TTFT {', '.join(_fmt(p['ttft_ms_p95']) for p in r['passes'])}; {r['completed']} of {r['submitted']}; "
                 f"other {', '.join(_fmt(p['foreign_cores'], '.2f') for p in r['passes'])}"
                 for r in (step["arms"][a] for a in arms)]
        lines.append(f"| {step['rate_rps']:g} | " + " | ".join(cells) + " |")
    if report["discarded"]:
        lines += ["", "Ramps run again (`--max-reruns`) because other processes used more than "
                  f"{report['args']['disturbed_cores']:g} cores in some step (kept in the JSON): "
                  + "; ".join(f"pass {d['pass']} {d['arm']}" for d in report["discarded"]) + "."]
    return "\n".join(lines) + "\n"


def _goodput_cell(arm: dict, disturbed_cores: float) -> str:
    per_pass = ", ".join(f"{r['goodput_rps']:.2f}{'*' if r['foreign_cores'] > disturbed_cores else ''}"
                         for r in arm["passes"])
    return f"{arm['goodput_rps_quiet_median']:.2f} ({per_pass})"


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configs = app_configs(args)
    workload = heldout_workload(args)
    load_start = [round(x, 2) for x in os.getloadavg()]
    ray_cluster()
    try:
        deploy(configs)
        steps, discarded = asyncio.run(ramp(args, list(configs), workload))
    finally:
        serve.shutdown()
        ray.shutdown()
    device = "one GPU for the engine" if args.device == "cuda" else "no GPU"
    report = {
        "machine": f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), {device}, "
                   "shared with other work",
        "machine_load": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
        "command": " ".join(["python -m benchmarks.controller_ramp", *(argv or [])]),
        "pair": pair_card(args), "arms": list(configs), "slos": args.slo,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "app_configs": configs, "steps": steps, "discarded": discarded,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main(sys.argv[1:])
