"""Served GPU evidence of docs/performance.md: the draft-length controller (spec and unified with it on, over
nospec, at 1 to 256 in flight and Poisson; its state every 0.5 s) and the prefix cache (TTFT p50, off over on).

    python3 benchmarks/gpu_evidence.py --part controller|prefix --out OUT [--budget-s 540]   (one GPU)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gpu_evidence.py --part PART --device cpu --out /tmp/ev
                                                               (CPU dry run: the path, not the numbers)

Apps on the constructed pair at agreement 0.8, through Serve's proxy; <part>.json and <part>.md rewritten
under --out after every point, within --budget-s. In the controller part each one-process mode's engine first
runs the same closed loops in process, without Serve (benchmarks/lib/in_process.py; --no-in-process skips it),
so that every served point stands beside its in-process one. Workloads, goals and the device calls:
docs/gpu_runs.md.
"""

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from itertools import groupby, product
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.constructed_pair import shape_configs  # noqa: E402
from benchmarks.lib.apps import AppRun, app_args, engine_args, run_app, sized_args  # noqa: E402
from benchmarks.lib.cluster import STARTED_S, git_commit, log, machine, serving, start_model_cluster  # noqa: E402
from benchmarks.lib.in_process import ENGINE_MODES, EngineLoad, measure_apart  # noqa: E402
from benchmarks.lib.loads import Load  # noqa: E402
from benchmarks.lib.pairs import SavedPair, save_pair  # noqa: E402
from benchmarks.lib.results import ratio, row, rows_table, script_parser, verdict, write_document  # noqa: E402
from loadtest.arrivals import ClosedLoop, OpenLoop  # noqa: E402
from loadtest.workload import WorkloadRequest  # noqa: E402

AGREEMENT = 0.8
DRAFT_LEN = 3
SEED = 0
FIRST_PROMPT_ID = 16  # prompts draw ids from here up, as every recorded run did
GOALS = {  # by part and check: (comparison, value)
    "controller": {"every point": (">=", 0.97), "1 and 16 in flight": (">=", 1.3),
                   "nospec served / in process": (">=", 0.9)},
    "prefix": {"ttft_p50 off / on": (">=", 3.0)},
}
# The controller's signals each sample keeps (controller_sampler), averaged per point (trace_by_point).
TRACED = ("verify_queue_depth", "requests_per_verify_batch", "decode_step_p95_ms", "arrival_rate_rps")
# Sizes by device, every key also a flag; cpu: the small pair on a 2-core machine, enough to walk every path.
PRESETS = {
    "cuda": dict(shape="tinyllama-7b", prompt_len=128, output_len=128, concurrencies="1,16,64,128,256",
                 requests_per_slot=2, min_measured_requests=64, settle_requests_per_slot=4, single_requests=4,
                 lane_num_cpus=1.0, prefix_tokens=2000, suffix_tokens=32, prefix_output_len=16, prefix_concurrency=4,
                 prefix_requests=32, request_timeout_s=180.0, deploy_timeout_s=300.0),
    "cpu": dict(shape="small", prompt_len=32, output_len=16, concurrencies="1,4,8",
                requests_per_slot=1, min_measured_requests=0, settle_requests_per_slot=1, single_requests=2,
                lane_num_cpus=0.25, prefix_tokens=200, suffix_tokens=8, prefix_output_len=4, prefix_concurrency=2,
                prefix_requests=4, request_timeout_s=300.0, deploy_timeout_s=600.0),
}


def shared_prefix_requests(vocab_size: int, count: int, prefix_len: int, suffix_len: int, output_len: int,
                           seed: int) -> list[WorkloadRequest]:
    """One system prompt of `prefix_len` random tokens (0: none, the controller part's prompts), each request's
    own `suffix_len` after it. The pair's word-level tokenizer reads token i as the word "t<i>": a prompt of n
    words is n tokens."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(FIRST_PROMPT_ID, vocab_size, prefix_len).tolist()
    prompts = [prefix + rng.integers(FIRST_PROMPT_ID, vocab_size, suffix_len).tolist() for _ in range(count)]
    kind = "shared_prefix" if prefix_len else "normal"
    return [WorkloadRequest(" ".join(f"t{i}" for i in ids), len(ids), output_len, kind) for ids in prompts]


def saved_pair(args: argparse.Namespace) -> tuple[SavedPair, int]:
    """The constructed pair of the device's shape (built and saved once under --pair-dir), and its vocabulary."""
    saved = save_pair(args.shape, AGREEMENT, args.pair_dir, dtype=args.dtype, device=args.device, seed=SEED)
    return saved, shape_configs(args.shape)[0]["vocab_size"]


def app_config(mode: str, pair: SavedPair, args: argparse.Namespace, *, engine: dict | None = None) -> dict:
    """configs/<mode>.yaml's args on `pair` (benchmarks/lib/apps.py app_args): the part's engine sizes, L =
    DRAFT_LEN, one GPU's lane shares (cuda), --engine merged into the engine block, --draft into the draft's; in
    the controller part, the controller on in the drafting modes, --controller merged into its block."""
    engine = {**engine_args(args.max_model_len, args.max_num_seqs, DRAFT_LEN), **(engine or {}), **args.engine}
    config = app_args(mode, pair.target, pair.draft, dtype=args.dtype, lane_num_cpus=args.lane_num_cpus, engine=engine,
                      one_gpu=args.device == "cuda", controller=args.part == "controller")
    if args.part == "controller" and mode != "nospec":
        config["controller"].update(json.loads(args.controller))
    if mode != "nospec":
        config["draft"].update(args.draft)
    return config


class Report:
    """One part's document: its apps, a row per point (benchmarks/lib/results.py's row, every submitted request
    counted), the checks against the goals; <part>.json and <part>.md rewritten under --out after every point."""

    def __init__(self, part: str, args: argparse.Namespace, argv: list[str]):
        self.part, self.args = part, args
        self.doc = {"part": part, "command": "python3 benchmarks/gpu_evidence.py " + " ".join(argv),
                    "commit": git_commit(), "machine": machine(),
                    "load_average_before": [round(x, 2) for x in os.getloadavg()],
                    "goals": {k: list(v) for k, v in GOALS[part].items()}, "apps": {}, "rows": [],
                    "checks": [], "notes": []}

    def serve(self, name: str, config: dict, port: int, loads: list[Load], deadline_s: float,
              sampler: Callable[[str, Load], Awaitable[None]] | None = None) -> AppRun:
        """Deploy `config` as app `name`, run `loads` in order (a row each as it ends), delete it."""
        a = self.args
        run = run_app(name, config, port, loads, deadline_s, deploy_timeout_s=a.deploy_timeout_s,
                      request_timeout_s=a.request_timeout_s, seed=SEED, on_point=self.add, sampler=sampler,
                      min_load_s=a.min_load_s)
        self.doc["apps"][name] = {"status": run.status, "error": run.error, "skipped": run.skipped,
                                  "deploy_s": round(run.deploy_s, 1) if run.deploy_s else None}
        return run

    def add(self, run: AppRun) -> None:
        load, point = run.points[-1]
        s = point.summary
        self.doc["rows"].append({**row(point, app=run.name, load=load.name), "measured": load.measured,
                                 "in_flight mean": round(s.mean_in_flight, 1), "in_flight max": s.max_in_flight,
                                 "accept_len": round(s.spec_decode.mean_acceptance_length, 3)
                                 if s.spec_decode and s.spec_decode.mean_acceptance_length else None})
        self.write()

    def write(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - STARTED_S, 1)
        self.doc["every_request_accounted"] = all(r["submitted"] == r["completed"] + r["failed"] + r["timed_out"]
                                                  for r in self.doc["rows"])
        write_document(self.args.out, self.part, self.doc, self.markdown())

    def markdown(self) -> str:
        d, m = self.doc, self.doc["machine"]
        lines = [f"# GPU evidence, part {d['part']} ({m.get('gpu') or m['cpu_model']})", "",
                 f"`{d['command']}`, commit {d['commit']}, {d['elapsed_s']:.0f} s; every submitted request "
                 f"accounted for: {d['every_request_accounted']}.", ""]
        lines += [f"- {n}" for n in d["notes"]] + [""]
        if d["checks"]:
            lines += ["## Against the goals", "", rows_table(d["checks"])]
        lines += ["## Apps", ""] + [f"- {name}: {json.dumps(status)}" for name, status in d["apps"].items()]
        lines += ["", "## Points", "", rows_table(d["rows"])]
        for key in d:
            if key.startswith("table:"):
                lines += [f"## {key[len('table:'):]}", "", rows_table(d[key])]
        return "\n".join(lines)


def row_of(report: Report, app: str, load: str) -> dict:
    """`app`'s row at `load` ({} where it was not measured)."""
    return next((r for r in report.doc["rows"] if r["app"] == app and r["load"] == load), {})


def check(goal: tuple[str, float], value: float | None, **labels) -> dict:
    return {**labels, "goal": f"{goal[0]} {goal[1]}", "verdict": verdict(value, goal)}


def controller_sampler(trace: list[dict], app: str):
    """An async sampler of the app's /v1/controller every 0.5 s into `trace` (times since the part started),
    each tagged with the point (load) it ran beside; "load" is the controller's own reading."""
    import httpx

    async def sample(url: str, load: Load) -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                try:
                    state = (await http.get(url + "/v1/controller")).json()
                except (httpx.HTTPError, ValueError) as exc:
                    state = {"error": repr(exc)}
                signals = state.get("signals") or {}
                # Beside L, why the controller chose it: the step-cost fit, the drafter's cost and the
                # decision's own account (a miss is diagnosed from these).
                keys = ("default_draft_len", "draft_len_cap", "load", "fleet_accept_rate", "step_cost",
                        "draft_cost_ratio", "reason")
                trace.append({"app": app, "point": load.name, "t_s": round(time.monotonic() - STARTED_S, 2),
                              **{k: state.get(k) for k in keys}, **{k: signals.get(k) for k in TRACED}})
                await asyncio.sleep(0.5)
    return sample


def settle_requests(args: argparse.Namespace, concurrency: int) -> int:
    """Requests of the unmeasured closed loop before the point at `concurrency`."""
    return max(3 * args.single_requests, args.settle_requests_per_slot * concurrency)


def controller_loads(requests: list[WorkloadRequest], concurrencies: list[int], args: argparse.Namespace,
                     poisson: dict) -> list[Load]:
    """Warm-up (max_num_seqs at once), the closed loops, then Poisson (`poisson`: the Load's arrivals, or
    its rate_of and factor). Each closed loop is measured after an unmeasured one at the same concurrency, on
    requests from the end of the list, and has at least `min_measured_requests` (why: docs/gpu_runs.md)."""
    loads = [Load("warmup", requests[: args.max_num_seqs], OpenLoop(float("inf")), measured=False)]
    for c in concurrencies:
        if args.settle_requests_per_slot:
            loads.append(Load(f"settle c{c}", requests[-settle_requests(args, c):], ClosedLoop(c), measured=False))
        count = args.single_requests if c == 1 else max(args.requests_per_slot * c, args.min_measured_requests)
        loads.append(Load(f"c{c}", requests[:count], ClosedLoop(c)))
    return loads + [Load("poisson", requests[: args.requests_per_slot * max(concurrencies)], **poisson)]


def controller_checks(report: Report, modes: list[str], loads: list[str]) -> list[dict]:
    """Each drafting mode's tok/s over nospec's at every load, against the goal that applies there."""
    checks = []
    for mode, load in product(modes, loads):
        value = ratio(row_of(report, mode, load).get("tok_s"), row_of(report, "nospec", load).get("tok_s"))
        goal = GOALS["controller"]["1 and 16 in flight" if load in ("c1", "c16") else "every point"]
        checks.append(check(goal, value, mode=mode, load=load, x_nospec=value))
    return checks


def engine_loads(loads: list[Load]) -> list[EngineLoad]:
    """The closed loops of `loads` (settling and measured), for the same engine in process."""
    return [EngineLoad(load.name, [r.prompt for r in load.requests], load.requests[0].output_len,
                       load.arrivals.concurrency, load.measured)
            for load in loads if isinstance(load.arrivals, ClosedLoop)]


def served_over_in_process(report: Report, in_process: dict[str, dict]) -> list[dict]:
    """Each mode's in-process row beside its served one at the same load: served / in process for tok/s,
    and both TTFTs and TPOTs."""
    rows = []
    for mode, result in in_process.items():
        for engine in result["rows"]:
            served = row_of(report, mode, engine["load"])
            rows.append({"mode": mode, "load": engine["load"], "in-process tok_s": engine["tok_s"],
                         "served tok_s": served.get("tok_s"),
                         "served / in process": ratio(served.get("tok_s"), engine["tok_s"]),
                         **{f"{metric} {way}": value for metric in ("ttft_ms p50", "tpot_ms p50")
                            for way, value in (("in process", engine[metric]), ("served", served.get(metric)))},
                         "in-process completed": f"{engine['completed']} of {engine['submitted']}",
                         "L in process": result["draft_len"]})
    return rows


def in_process_checks(rows: list[dict]) -> list[dict]:
    """nospec, the baseline, served at >= 0.9x its speed in process at every closed loop: else the mode
    comparison does not count."""
    return [check(GOALS["controller"]["nospec served / in process"], r["served / in process"], mode="nospec",
                  load=r["load"], served_over_in_process=r["served / in process"])
            for r in rows if r["mode"] == "nospec"]


def trace_by_point(trace: list[dict]) -> list[dict]:
    """What the controller saw and set during each point: mean L and the mean of each signal."""
    rows = []
    for (app, load), group in groupby(trace, key=lambda sample: (sample["app"], sample["point"])):
        samples = list(group)  # a load's samples are consecutive: one sampler runs at a time
        means = {"app": app, "load": load, "samples": len(samples)}
        for key in ("default_draft_len", "draft_len_cap", *TRACED):
            values = [s[key] for s in samples if isinstance(s.get(key), (int, float))]
            means[f"{key} mean"] = round(float(np.mean(values)), 2) if values else None
        rows.append(means)
    return rows


def part_controller(args: argparse.Namespace, report: Report, port: int, deadline_s: float) -> None:
    pair, vocab_size = saved_pair(args)
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    top = f"c{max(concurrencies)}"
    # Measured requests first, then the warm-up's, then the settling loads' (taken from the end: the
    # measured prompts stay out of the prefix cache).
    count = args.requests_per_slot * max(concurrencies) + args.max_num_seqs + settle_requests(args, max(concurrencies))
    requests = shared_prefix_requests(vocab_size, count, 0, args.prompt_len, args.output_len, SEED)
    modes = args.modes.split(",")
    configs = {mode: app_config(mode, pair, args) for mode in modes}
    controller = next((config["controller"] for mode, config in configs.items() if mode != "nospec"), None)
    report.doc["notes"] += [
        f"Constructed {args.shape} pair, agreement {AGREEMENT}; {args.prompt_len} random prompt tokens, "
        f"{args.output_len} output tokens, greedy; max_num_seqs {args.max_num_seqs}; "
        f"controller {json.dumps(controller)}.",
        f"poisson: {args.rate_factor} x nospec's completed requests/s at {top}, the same arrival times for every "
        "mode. Each closed loop is measured after an unmeasured one at the same C (controller_loads)."]
    trace = report.doc["controller_trace"] = []  # the sampler's, filled as the apps run
    # The same engines in process first (each in a process of its own, gone before any app deploys).
    in_process = {}
    closed = engine_loads(controller_loads(requests, concurrencies, args, {"rate_of": top}))
    for mode in (m for m in modes if args.in_process and m in ENGINE_MODES):
        log(f"{mode} in process")
        in_process[mode] = measure_apart(configs[mode], closed)
        report.doc.setdefault("in_process", {})[mode] = in_process[mode]
        report.write()
    for index, mode in enumerate(modes):
        share_s = (deadline_s - time.monotonic()) / (len(modes) - index)
        # nospec runs first and fixes the rate; the others get its rate and arrival times (none: skipped, as
        # a rate taken from a load this app does not have).
        rate_rps = report.doc.get("poisson_rate_rps")
        poisson = ({"rate_of": top, "factor": args.rate_factor} if mode == "nospec" else
                   {"arrivals": OpenLoop(rate_rps)} if rate_rps else {"rate_of": f"nospec {top}"})
        run = report.serve(mode, configs[mode], port, controller_loads(requests, concurrencies, args, poisson),
                           time.monotonic() + share_s, None if mode == "nospec" else controller_sampler(trace, mode))
        if mode == "nospec":
            nospec = next((point.summary for load, point in run.points if load.name == top), None)
            report.doc["poisson_rate_rps"] = args.rate_factor * nospec.request_throughput_rps if nospec else None
        side_by_side = served_over_in_process(report, in_process)
        report.doc["checks"] = controller_checks(report, [m for m in modes if m != "nospec"],
                                                 [f"c{c}" for c in concurrencies] + ["poisson"]) + \
            in_process_checks(side_by_side)
        report.doc["table:Served beside the same engine in process (no Serve, no controller: L fixed)"] = side_by_side
        report.doc["table:What the controller saw and set, per point (means over 0.5 s samples)"] = \
            trace_by_point(trace)
        report.write()


def prefix_checks(report: Report, modes: list[str]) -> list[dict]:
    checks = []
    for mode in modes:
        off, on = (row_of(report, f"{mode}-cache-{cache}", "shared").get("ttft_ms p50") for cache in ("off", "on"))
        value = ratio(off, on)
        checks.append(check(GOALS["prefix"]["ttft_p50 off / on"], value, mode=mode,
                            **{"ttft_p50_ms off": off, "ttft_p50_ms on": on, "off / on": value}))
    return checks


def part_prefix(args: argparse.Namespace, report: Report, port: int, deadline_s: float) -> None:
    pair, vocab_size = saved_pair(args)
    modes = args.modes.split(",")
    max_model_len = args.prefix_tokens + args.suffix_tokens + args.prefix_output_len + 64
    report.doc["notes"] += [
        f"One system prompt of {args.prefix_tokens} random tokens, then {args.suffix_tokens} of each request's own, "
        f"{args.prefix_output_len} output tokens, greedy; {args.prefix_requests} requests at {args.prefix_concurrency} "
        "in flight after 2 unmeasured ones (where the cache-on apps meet the prefix first); max_model_len "
        f"{max_model_len}. Every app draws the same requests: only enable_prefix_caching differs."]
    apps = [(mode, cache) for mode in modes for cache in ("off", "on")]
    for index, (mode, cache) in enumerate(apps):
        share_s = (deadline_s - time.monotonic()) / (len(apps) - index)
        requests = shared_prefix_requests(vocab_size, args.prefix_requests + 2, args.prefix_tokens,
                                          args.suffix_tokens, args.prefix_output_len, SEED + 9)
        loads = [Load("warmup", requests[:2], ClosedLoop(1), measured=False),
                 Load("shared", requests[2:], ClosedLoop(args.prefix_concurrency))]
        engine = {"enable_prefix_caching": cache == "on", "max_model_len": max_model_len,
                  "max_num_seqs": max(args.prefix_concurrency, 8)}
        report.serve(f"{mode}-cache-{cache}", app_config(mode, pair, args, engine=engine), port, loads,
                     time.monotonic() + share_s)
        report.doc["checks"] = prefix_checks(report, modes)
        report.write()


SERVED_PARTS = {"controller": part_controller, "prefix": part_prefix}
DEFAULT_MODES = {"controller": "nospec,spec,unified", "prefix": "unified,pdv"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__, budget_s=540.0)
    parser.add_argument("--part", required=True, choices=SERVED_PARTS)
    parser.add_argument("--modes", default=None, help="controller: nospec first (it sets the Poisson rate), "
                        "default nospec,spec,unified; prefix: default unified,pdv")
    parser.add_argument("--controller", default="{}", help="JSON merged into the controller block (controller part)")
    parser.add_argument("--engine", type=json.loads, default={}, help="JSON merged into every app's engine block")
    parser.add_argument("--draft", type=json.loads, default={}, help="JSON merged into the drafting modes' draft "
                        "block, e.g. '{\"quantization\": \"int8\"}'")
    parser.add_argument("--rate-factor", type=float, default=0.9,
                        help="controller: Poisson at this x nospec's completed requests/s at the most in flight")
    parser.add_argument("--min-load-s", type=float, default=15.0, help="a load starts only with this much left")
    parser.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=True,
                        help="controller: first the closed loops on each one-process mode's engine, without Serve")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the most in flight, at least 8")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: prompt + output + 64")
    args = sized_args(parser, PRESETS, argv)  # and the dtype: lib/apps.py's PRESETS
    args.modes = args.modes or DEFAULT_MODES[args.part]
    args.max_num_seqs = args.max_num_seqs or max(8, *(int(c) for c in args.concurrencies.split(",")))
    args.max_model_len = args.max_model_len or args.prompt_len + args.output_len + 64
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    deadline_s = time.monotonic() + args.budget_s - 20  # the shutdown and the last write
    report = Report(args.part, args, argv)
    with serving(start_model_cluster()) as port:
        log(f"Ray and Serve up (port {port}); part {args.part}, budget {args.budget_s:.0f} s")
        try:
            SERVED_PARTS[args.part](args, report, port, deadline_s)
        finally:
            report.write()
    log(f"done: {args.out / args.part}.json / .md; checks {json.dumps(report.doc['checks'])}")


if __name__ == "__main__":
    main()
