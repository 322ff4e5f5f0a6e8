"""Goodput across a load ramp: the draft-length controller against fixed draft lengths L.

    python -m benchmarks.controller_ramp --out benchmarks/results/controller_ramp_cpu

Deploys one app per arm on the shipped pair (models/vpd-target + models/vpd-draft), all in mode unified:
"L0", "L2", "L4", "L8" (controller off, num_speculative_tokens = L) and "controller" (controller on,
starting at L = 4, lowest L 2); `--arms` may add "controller-min0", the same controller allowed to turn
speculation off (min_draft_len 0). Then drives each arm, one after the other, through the whole ramp: for
every rate, `--step-duration-s` seconds of open-loop (Poisson) arrivals with the load tester
(loadtest.runner.run_load), which waits for every request in flight to end before the next rate starts.
An arm's steps follow each other without a pause, so a controller meets the ramp as one rising load, with
its state carried from step to step. The whole sequence runs `--passes` times, every other pass with the
arms in reverse order, and goodput is averaged over passes.

Prompts are windows of the held-out part of the training corpus (Python source the pair never saw),
decoded greedily, the setting in which models/pair_metrics.json measured the pair's acceptance.

Writes <out>.json (every summary, the controllers' decisions sampled during their runs) and <out>.md.
"""

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import ray
from ray import serve

from deployments.config import DEFAULT_DRAFT, DEFAULT_TARGET, REPO_ROOT
from loadtest.arrivals import OpenLoop
from loadtest.client import RequestOptions
from loadtest.runner import RunResult, run_load
from loadtest.summary import parse_slos
from loadtest.workload import WorkloadRequest, count_tokens, load_tokenizer
from tests.serve_helpers import base_url, deploy, start_ray
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
}
LANE = {"num_cpus": 0.05}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/controller_ramp_cpu",
                        help="path without suffix: writes <out>.json and <out>.md")
    parser.add_argument("--rates", default="1,2.5,4,6", help="ramp steps, requests per second")
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
    parser.add_argument("--passes", type=int, default=2, help="times each arm runs the whole ramp")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.slo = parse_slos(args.slo or DEFAULT_SLOS)
    return args


def app_configs(args: argparse.Namespace) -> dict[str, dict]:
    base = {
        "mode": "unified", "target": {"path": DEFAULT_TARGET}, "draft": {"path": DEFAULT_DRAFT},
        "ingress": LANE, "decode_lane": LANE,
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
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    heldout = collect_corpus(include_site_packages=False).heldout
    stream = [t for f in heldout for t in tokenizer.encode(f.text, add_special_tokens=False)]
    step = (len(stream) - args.prompt_tokens) // args.num_prompts
    prompts = [tokenizer.decode(stream[i * step : i * step + args.prompt_tokens]) for i in range(args.num_prompts)]
    return [WorkloadRequest(prompt=p, prompt_len=count_tokens(tokenizer, p), output_len=args.output_tokens)
            for p in prompts]


async def sample_controller(url: str, trace: list[dict], every_s: float = 0.5) -> None:
    """Append the controller's last decision to `trace` every `every_s` until cancelled."""
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            state = (await http.get(url)).json()
            trace.append({"t_s": round(time.monotonic() - start, 2), "decision_index": state.get("decision_index"),
                          "default_draft_len": state.get("default_draft_len"),
                          "load": state.get("load"), "fleet_accept_rate": state.get("fleet_accept_rate"),
                          "verify_queue_depth": (state.get("signals") or {}).get("verify_queue_depth")})
            await asyncio.sleep(every_s)


async def run_arm(name: str, rate_rps: float, workload: list[WorkloadRequest], args) -> tuple[RunResult, list[dict]]:
    base = base_url(name).removesuffix("/v1")
    trace: list[dict] = []
    sampler = None
    if name in CONTROLLER_ARMS:
        sampler = asyncio.create_task(sample_controller(f"{base}/v1/controller", trace))
    try:
        result = await run_load(base, workload, OpenLoop(rate_rps), duration_s=args.step_duration_s,
                                options=RequestOptions(temperature=0.0), seed=args.seed, progress=False)
    finally:
        if sampler is not None:
            sampler.cancel()
    return result, trace


def arm_row(result: RunResult, trace: list[dict], slos: dict[str, float]) -> dict:
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
        "summary": s.to_dict(),
    }
    if trace:
        row["controller_trace"] = trace
    return row


def verdict(step: dict, arm: str) -> dict:
    fixed = {n: r["goodput_rps"] for n, r in step["arms"].items() if n not in CONTROLLER_ARMS}
    best = max(fixed, key=fixed.get)
    ours = step["arms"][arm]["goodput_rps"]
    if fixed[best] == 0:
        return {"best_fixed": best, "best_fixed_goodput_rps": 0.0, "controller_goodput_rps": ours, "ratio": None,
                "outcome": "beats" if ours > 0 else "matches"}
    ratio = ours / fixed[best]
    outcome = "beats" if ratio > 1 + MATCH_TOLERANCE else "matches" if ratio >= 1 - MATCH_TOLERANCE else "below"
    return {"best_fixed": best, "best_fixed_goodput_rps": fixed[best], "controller_goodput_rps": ours,
            "ratio": ratio, "outcome": outcome}


async def ramp(args: argparse.Namespace, arms: list[str], workload: list[WorkloadRequest]) -> list[dict]:
    rates = [float(r) for r in args.rates.split(",")]
    runs: dict[tuple[float, str], list[dict]] = {(rate, name): [] for rate in rates for name in arms}
    for p in range(args.passes):
        # Every other pass in reverse order: a drift in the machine's other load then hits all arms alike.
        for name in arms if p % 2 == 0 else arms[::-1]:
            # A few requests first, so that no arm pays for cold caches in its first step.
            await run_load(base_url(name).removesuffix("/v1"), workload[:8], OpenLoop(2.0), progress=False)
            for rate in rates:
                result, trace = await run_arm(name, rate, workload, args)
                row = arm_row(result, trace, args.slo)
                runs[rate, name].append(row)
                print(f"pass {p}  {name:16s} rate {rate:g} rps  goodput {row['goodput_rps']:.2f} rps  "
                      f"mean L {row['mean_draft_len']:.2f}", flush=True)
    steps = []
    for rate in rates:
        step = {"rate_rps": rate, "arms": {name: combine(runs[rate, name]) for name in arms}}
        if any(a not in CONTROLLER_ARMS for a in arms):
            step["verdicts"] = {a: verdict(step, a) for a in arms if a in CONTROLLER_ARMS}
        steps.append(step)
    return steps


def combine(passes: list[dict]) -> dict:
    """One arm at one rate over all passes: mean goodput and L, every pass kept."""
    return {"goodput_rps": statistics.mean(r["goodput_rps"] for r in passes),
            "mean_draft_len": statistics.mean(r["mean_draft_len"] for r in passes),
            "submitted": sum(r["submitted"] for r in passes), "completed": sum(r["completed"] for r in passes),
            "passes": passes}


def pair_card() -> dict:
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
    accept = ", ".join(f"L={L}: {a:.3f}" for L, a in report["pair"]["greedy_acceptance_per_drafted_token"].items())
    lines = [
        "# Controller vs fixed draft length: goodput across a load ramp (CPU)",
        "",
        f"Machine: {report['machine']}. Pair: {report['pair']['target']} + {report['pair']['draft']}, greedy "
        f"acceptance per drafted token as measured in models/pair_metrics.json: {accept}.",
        "",
        f"Mode unified (one replica, max_num_seqs {report['args']['max_num_seqs']}), held-out Python prompts of "
        f"{report['args']['prompt_tokens']} tokens, {report['args']['output_tokens']} output tokens, temperature 0, "
        f"Poisson arrivals, {report['args']['step_duration_s']:g} s of arrivals per step and arm. Goodput: "
        f"completed requests meeting {slos}, per second. Controller block: `{report['args']['controller']}`, "
        f"min_draft_len per arm: {', '.join(f'{a} {CONTROLLER_ARMS[a]}' for a in controllers)}. "
        f"Command: `{report['command']}`.",
        "",
        f"Goodput (requests/s), mean over {report['args']['passes']} passes (each pass in parentheses); "
        f"controller / best fixed on the means, 'matches' meaning within ±{MATCH_TOLERANCE:.0%}:",
        "",
        "| rate (req/s) | " + " | ".join(arms) + " | best fixed | "
        + " | ".join(f"{a} / best" for a in controllers) + " |",
        "|---" * (len(arms) + 2 + len(controllers)) + "|",
    ]
    for step in report["steps"]:
        verdicts = step.get("verdicts", {})
        cells = [_goodput_cell(step["arms"][a]) for a in arms]
        best = next(iter(verdicts.values()), {}).get("best_fixed", "")
        ratios = [f"{_fmt(v['ratio'], '.2f')} ({v['outcome']})" for v in verdicts.values()]
        lines.append(f"| {step['rate_rps']:g} | " + " | ".join(cells + [best] + ratios) + " |")
    lines += ["", "Mean L of speculated verify steps; p95 TPOT ms and p95 TTFT ms per pass; completed of "
              "submitted, all passes:", "",
              "| rate (req/s) | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for step in report["steps"]:
        cells = [f"L {r['mean_draft_len']:.1f}; TPOT {', '.join(_fmt(p['tpot_ms_p95']) for p in r['passes'])}; "
                 f"TTFT {', '.join(_fmt(p['ttft_ms_p95']) for p in r['passes'])}; {r['completed']} of {r['submitted']}"
                 for r in (step["arms"][a] for a in arms)]
        lines.append(f"| {step['rate_rps']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _goodput_cell(arm: dict) -> str:
    return f"{arm['goodput_rps']:.2f} ({', '.join(f'{p:.2f}' for p in (r['goodput_rps'] for r in arm['passes']))})"


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configs = app_configs(args)
    workload = heldout_workload(args)
    start_ray()
    try:
        deploy(configs)
        steps = asyncio.run(ramp(args, list(configs), workload))
    finally:
        serve.shutdown()
        ray.shutdown()
    report = {
        "machine": f"2-core CPU ({platform.processor() or platform.machine()}), no GPU, shared with other work",
        "command": " ".join(["python -m benchmarks.controller_ramp", *(argv or [])]),
        "pair": pair_card(), "arms": list(configs), "slos": args.slo,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "app_configs": configs, "steps": steps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main(sys.argv[1:])
