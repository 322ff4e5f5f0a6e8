"""`python -m loadtest {run,sweep,compare}`: drive OpenAI-style endpoints and report.

    run      one target at one load
    sweep    one target at several loads (--rates 1,2,4 or --concurrencies 1,4,16)
    compare  several targets (--target nospec=URL --target pdv=URL ...), each with the same
             seeded workload at the same load(s), printed side by side

Every command writes result.json / requests.csv per run and compare.csv / compare.txt /
latency_cdf.png (and load_curve.png for several loads) under --output-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

from loadtest.arrivals import Arrivals, ClosedLoop, OpenLoop
from loadtest.client import RequestOptions
from loadtest.memory import MemorySamples, sample_memory, write_memory
from loadtest.report import Point, write_comparison, write_point
from loadtest.runner import run_load
from loadtest.summary import parse_slos
from loadtest.workload import (LengthFilter, LogNormal, WorkloadRequest, fit_lognormal,
                               load_sharegpt, load_tokenizer, mix_long_prompts, synthetic)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="one target at one load")
    sweep = commands.add_parser("sweep", help="one target at several loads")
    compare = commands.add_parser("compare", help="several targets side by side")
    for sub in (run, sweep):
        sub.add_argument("--base-url", default="http://127.0.0.1:8000")
        sub.add_argument("--label", default="target", help="name of the target in tables")
    compare.add_argument("--target", action="append", required=True, metavar="LABEL=URL",
                         help="a target to compare, e.g. pdv=http://127.0.0.1:8000 (repeat)")
    for sub in (run, sweep, compare):
        _add_workload_args(sub)
        _add_load_args(sub, several=sub is not run)
        _add_request_args(sub)
        _add_output_args(sub)
    return parser


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=["synthetic", "sharegpt"], default="synthetic")
    group.add_argument("--dataset-path", type=Path, help="ShareGPT-format JSON file")
    group.add_argument("--tokenizer", type=Path, default=None,
                       help="tokenizer directory for token lengths (default models/vpd-target)")
    group.add_argument("--seed", type=int, default=0, help="makes the workload repeatable")
    group.add_argument("--min-prompt-len", type=int, default=4)
    group.add_argument("--max-prompt-len", type=int, default=1024)
    group.add_argument("--min-output-len", type=int, default=4)
    group.add_argument("--max-output-len", type=int, default=None)
    group.add_argument("--max-total-len", type=int, default=2048,
                       help="ShareGPT filter on prompt + output tokens")
    group.add_argument("--output-len", type=int, default=None,
                       help="ShareGPT: fix every output length instead of the reply's")
    group.add_argument("--prompt-len-median", type=float, default=128)
    group.add_argument("--prompt-len-sigma", type=float, default=1.0)
    group.add_argument("--output-len-median", type=float, default=128)
    group.add_argument("--output-len-sigma", type=float, default=0.8)
    group.add_argument("--synthetic-fit", type=Path, default=None, metavar="SHAREGPT_JSON",
                       help="synthetic: fit the log-normal lengths to this ShareGPT file")
    group.add_argument("--long-prompt-share", type=float, default=0.0,
                       help="share of requests given a long prompt (prefill interference)")
    group.add_argument("--long-prompt-len", type=int, default=2048)


def _add_load_args(parser: argparse.ArgumentParser, several: bool) -> None:
    group = parser.add_argument_group("load")
    length = group.add_mutually_exclusive_group()
    length.add_argument("--num-requests", type=int, default=200,
                        help="measured requests (the run length in requests)")
    length.add_argument("--duration-s", type=float, default=None,
                        help="submit for this long instead; requests in flight still finish")
    group.add_argument("--pool-size", type=int, default=1000,
                       help="with --duration-s: distinct requests, cycled")
    group.add_argument("--warmup-requests", type=int, default=5,
                       help="sent first at the same load, excluded from results")
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="open-loop mean requests/s (inf: all at once)")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of arrival gaps: 1 = Poisson, < 1 burstier")
    group.add_argument("--max-concurrency", type=int, default=None,
                       help="closed loop: keep this many requests in flight instead of a rate")
    if several:
        group.add_argument("--rates", type=_floats, default=None, help="e.g. 1,2,4 (req/s)")
        group.add_argument("--concurrencies", type=_ints, default=None, help="e.g. 1,4,16")


def _add_request_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("requests")
    group.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    group.add_argument("--model", default=None, help="default: first id of GET /v1/models")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--timeout-s", type=float, default=300.0,
                       help="a request still running after this is recorded as timed_out")


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--output-dir", type=Path, default=None,
                       help="default results/loadtest/<UTC time>-<command>")
    group.add_argument("--slo", action="append", default=[], metavar="NAME=MS",
                       help="goodput SLO: ttft_ms, tpot_ms or e2e_ms (repeat)")
    group.add_argument("--no-progress", action="store_true")
    group.add_argument("--memory-sample-s", type=float, default=0.0,
                       help="soak runs: sample every replica's RSS (and GPU memory) this often, into "
                            "memory.csv / memory.png (the tester must run on the replicas' node)")
    group.add_argument("--memory-warmup-s", type=float, default=120.0,
                       help="memory growth is measured from this far into the run")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def targets_from_args(args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.command != "compare":
        return [(args.label, args.base_url)]
    targets = []
    for item in args.target:
        label, sep, url = item.partition("=")
        if not sep or not label or not url:
            raise SystemExit(f"--target {item!r}: expected LABEL=URL")
        targets.append((label, url))
    return targets


def loads_from_args(args: argparse.Namespace) -> list[Arrivals]:
    if getattr(args, "rates", None):
        return [OpenLoop(rate, args.burstiness) for rate in args.rates]
    if getattr(args, "concurrencies", None):
        return [ClosedLoop(c) for c in args.concurrencies]
    if args.max_concurrency is not None:
        return [ClosedLoop(args.max_concurrency)]
    return [OpenLoop(args.request_rate, args.burstiness)]


def workload_from_args(args: argparse.Namespace) -> tuple[list[WorkloadRequest],
                                                          list[WorkloadRequest]]:
    """(warm-up requests, measured requests), all drawn from one seeded workload."""
    tokenizer = load_tokenizer(args.tokenizer)
    measured = args.pool_size if args.duration_s is not None else args.num_requests
    total = args.warmup_requests + measured
    if args.dataset == "sharegpt":
        if args.dataset_path is None:
            raise SystemExit("--dataset sharegpt needs --dataset-path")
        requests = load_sharegpt(args.dataset_path, tokenizer, total, args.seed,
                                 _length_filter(args), output_len=args.output_len)
    else:
        prompt_lengths, output_lengths = _synthetic_lengths(args, tokenizer)
        requests = synthetic(tokenizer, total, args.seed, prompt_lengths, output_lengths)
    if args.long_prompt_share > 0:
        requests = mix_long_prompts(requests, args.long_prompt_share, args.long_prompt_len,
                                    tokenizer, args.seed)
    return requests[:args.warmup_requests], requests[args.warmup_requests:]


def _length_filter(args: argparse.Namespace) -> LengthFilter:
    return LengthFilter(min_prompt_len=args.min_prompt_len, max_prompt_len=args.max_prompt_len,
                        min_output_len=args.min_output_len, max_output_len=args.max_output_len,
                        max_total_len=args.max_total_len)


def _synthetic_lengths(args: argparse.Namespace, tokenizer) -> tuple[LogNormal, LogNormal]:
    max_output_len = args.max_output_len or args.max_prompt_len
    if args.synthetic_fit is None:
        return (LogNormal(args.prompt_len_median, args.prompt_len_sigma,
                          args.min_prompt_len, args.max_prompt_len),
                LogNormal(args.output_len_median, args.output_len_sigma,
                          args.min_output_len, max_output_len))
    sample = load_sharegpt(args.synthetic_fit, tokenizer, args.pool_size, args.seed,
                           _length_filter(args))
    return (fit_lognormal([r.prompt_len for r in sample], args.min_prompt_len,
                          args.max_prompt_len),
            fit_lognormal([r.output_len for r in sample], args.min_output_len, max_output_len))


def request_options(args: argparse.Namespace) -> RequestOptions:
    return RequestOptions(endpoint=args.endpoint, model=args.model,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)


async def run_points(args: argparse.Namespace, warmup: list[WorkloadRequest],
                     workload: list[WorkloadRequest], output_dir: Path) -> list[Point]:
    """Every (target, load) in turn, each with the same workload; writes each run's files."""
    slos = parse_slos(args.slo)
    config = json.loads(json.dumps(vars(args), default=str))
    points = []
    for label, base_url in targets_from_args(args):
        for arrivals in loads_from_args(args):
            samples, stop = MemorySamples(), asyncio.Event()
            sampler = (asyncio.create_task(sample_memory(base_url, args.memory_sample_s, samples, stop))
                       if args.memory_sample_s > 0 else None)
            try:
                result = await run_load(base_url, workload, arrivals, duration_s=args.duration_s,
                                        warmup=warmup, options=request_options(args),
                                        timeout_s=args.timeout_s, seed=args.seed,
                                        progress=not args.no_progress)
            finally:
                stop.set()
                if sampler is not None:
                    await sampler
            point = Point(label=label, result=result, summary=result.summary(slos))
            directory = write_point(output_dir, point, config)
            if sampler is not None:
                _add_memory(directory, write_memory(directory, samples, args.memory_warmup_s))
            print(f"{point.name}: {_one_line(point)} -> {directory}")
            points.append(point)
    return points


def _add_memory(directory: Path, memory: dict) -> None:
    """Each process's memory growth into result.json, and a line of it on the console."""
    document = json.loads((directory / "result.json").read_text())
    document["memory"] = memory
    (directory / "result.json").write_text(json.dumps(document, indent=2))
    for name, m in memory.items():
        print(f"  {name}: RSS {m['rss_after_warmup_mib']:.0f} -> {m['rss_last_mib']:.0f} MiB "
              f"({100 * m['growth_frac']:+.1f} %), peak {m['rss_peak_mib']:.0f} MiB")


def _one_line(point: Point) -> str:
    s = point.summary
    return (f"submitted {s.submitted}, completed {s.completed}, failed {s.failed}, "
            f"timed out {s.timed_out}, {s.output_token_throughput_tps:.1f} output tok/s")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    parse_slos(args.slo)  # reject a malformed SLO before any request is sent
    output_dir = args.output_dir or Path("results/loadtest") / (
        time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{args.command}")
    output_dir.mkdir(parents=True, exist_ok=True)
    warmup, workload = workload_from_args(args)
    print(f"workload: {len(workload)} requests (+{len(warmup)} warm-up), "
          f"{_workload_line(workload)}")
    points = asyncio.run(run_points(args, warmup, workload, output_dir))
    write_comparison(output_dir, points)
    print((output_dir / "compare.txt").read_text())
    print(f"\ntable: {output_dir / 'compare.csv'}, {output_dir / 'compare.txt'}; "
          f"plots: {output_dir / 'latency_cdf.png'}"
          + (f", {output_dir / 'load_curve.png'}" if (output_dir / "load_curve.png").exists()
             else ""))


def _workload_line(workload: list[WorkloadRequest]) -> str:
    prompt = sum(r.prompt_len for r in workload)
    output = sum(r.output_len for r in workload)
    long_prompts = sum(r.kind == "long" for r in workload)
    return (f"{prompt} prompt tokens, {output} output tokens asked for, "
            f"{long_prompts} long prompts")
