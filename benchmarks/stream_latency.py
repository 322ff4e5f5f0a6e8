"""What a streaming client sees under each stream-coalescing setting: one deployment per setting, each
loaded at several concurrencies through Serve's proxy and the OpenAI ingress, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stream_latency.py --device cpu --modes nospec --out /tmp/sl
    python3 benchmarks/stream_latency.py --device cuda --modes nospec,spec --out OUT

`--settings` names each setting as NAME:STREAM_INTERVAL_MS:MAX_STREAM_MESSAGES_PER_S[:KEY=JSON...] (0: no
bound; a KEY is an engine key, e.g. `eager:0:400:cuda_graphs=false` serves with eager forwards, an app config
key, e.g. `step:0:0:stream_channel="step"`, or a dotted path into the app config, e.g.
`wide:0:0:ingress.num_replicas=4` serves through four ingress replicas);
the default compares the old default (50 ms, 400/s) with streaming every step (0, none). Each point is
a closed loop of random token-id prompts (greedy, ignore_eos) with the load tester's streaming client,
after a warm-up at the largest concurrency. Per point: tok/s, the client's ITL p50/p99 (the gap between
two chunks of a request), TPOT p50/p99, the p99 over requests of each one's longest gap (decode stall),
TTFT p50, every request counted, and from the decode replica's counters over the point: the engine's
mean step and decode-only step (ms), stream messages per step (and, with `stream_channel: step`, the
channel messages that carried them), and the share of step outputs that went
out merged into another's message (num_coalesced / (messages + num_coalesced)); and the cores each
process on the stream's path used over the point (`cpu_<role>`: the engine's process, the decode
replica, the ingress replica, Serve's proxy, this client; benchmarks/lib/proc_cpu.py).

Writes stream_latency_<device>.json and .md under --out, after every point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import ray
from ray import serve
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.apps import GPU_SHARES, MAX_ONGOING  # noqa: E402
from benchmarks.lib.cluster import (benchmark_app_args, deploy, free_device_memory, git_commit, log, machine,  # noqa: E402
                                    serve_env, start_cluster)
from benchmarks.lib.pairs import save_pair  # noqa: E402
from benchmarks.lib.proc_cpu import CpuMeter, serve_processes  # noqa: E402
from benchmarks.lib.results import rows_table  # noqa: E402
from benchmarks.lib.engine_runs import random_work  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from lanes.engine.step_profile import StepProfile  # noqa: E402
from loadtest.arrivals import ClosedLoop  # noqa: E402
from loadtest.client import RequestOptions  # noqa: E402
from loadtest.runner import run_load  # noqa: E402

DEFAULT_SETTINGS = "old:50:400,every_step:0:0"
OPTIONS = RequestOptions(endpoint="completions", temperature=0.0, ignore_eos=True)


def app_config(mode: str, target: Path | None, draft: Path | None, args: argparse.Namespace) -> dict:
    engine = {"max_num_seqs": args.max_num_seqs, "max_model_len": args.prompt_len + args.output_len + 64,
              "num_speculative_tokens": args.draft_len, "max_draft_len": max(args.draft_len, 8)}
    return benchmark_app_args(mode, target, draft, dtype=args.dtype, engine=engine, lane_num_cpus=args.lane_num_cpus,
                              max_ongoing=MAX_ONGOING, gpu_shares=GPU_SHARES[mode] if args.device == "cuda" else None)


def replica_counters(handle) -> dict:
    """Steps, time in steps and stream messages of the app's one DecodeLane replica, cumulative."""
    stats = handle.stats.remote().result()
    return {**{k: stats[k] for k in ("num_steps", "step_ms_total", "num_messages", "channel_messages", "pid")},
            "profile": StepProfile(**stats["step_profile"])}


def _r(value, digits: int = 2):
    return None if value is None else round(value, digits)


def parse_settings(text: str) -> list[tuple[str, float, float | None, dict]]:
    settings = []
    for item in text.split(","):
        name, interval_ms, rate, *engine = item.split(":")
        overrides = {key: json.loads(value) for key, value in (pair.split("=", 1) for pair in engine)}
        settings.append((name, float(interval_ms), float(rate) or None, overrides))
    return settings


def apply_overrides(config: dict, overrides: dict) -> None:
    """A setting's KEY=JSON pairs: an app config key (`stream_channel`), a dotted path into the app config
    (`ingress.num_replicas`), else an engine key."""
    for key, value in overrides.items():
        top = key in AppConfig.model_fields
        *path, last = key.split(".") if "." in key or top else ("engine", key)
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value


def load_point(name: str, port: int, work, concurrency: int, timeout_s: float) -> dict:
    handle = serve.get_deployment_handle("DecodeLane", app_name=name)
    before = replica_counters(handle)
    stats = handle.stats.remote().result()
    before_coalesced = stats.get("num_coalesced", 0)
    meter = CpuMeter(point_processes(name, stats)).start()
    result = asyncio.run(run_load(f"http://127.0.0.1:{port}/{name}", work.workload(), ClosedLoop(concurrency),
                                  options=OPTIONS, timeout_s=timeout_s, progress=False))
    cores = meter.stop()
    after = replica_counters(handle)
    coalesced = handle.stats.remote().result().get("num_coalesced", 0) - before_coalesced
    s = result.summary()
    steps, step_ms, messages, channel_messages = (after[k] - before[k] for k in (
        "num_steps", "step_ms_total", "num_messages", "channel_messages"))
    profile = after["profile"].since(before["profile"]).summary()
    gaps = [max(r.itl_ms) for r in result.records if r.status == "completed" and r.itl_ms]
    lat = s.latency_ms
    return {"concurrency": concurrency, "submitted": s.submitted, "completed": s.completed, "failed": s.failed,
            "timed_out": s.timed_out, "output_tok_s": _r(s.output_token_throughput_tps, 1),
            "itl_p50_ms": _r(lat["itl_ms"].p50), "itl_p99_ms": _r(lat["itl_ms"].p99),
            "tpot_p50_ms": _r(lat["tpot_ms"].p50), "tpot_p99_ms": _r(lat["tpot_ms"].p99),
            "stall_p99_ms": _r(float(np.percentile(gaps, 99)) if gaps else None),
            "ttft_p50_ms": _r(lat["ttft_ms"].p50),
            "step_ms_mean": _r(step_ms / steps if steps else None),
            "decode_step_ms": _r(profile.get("decode_only_step_ms")),
            "itl_p50_over_step": _r(lat["itl_ms"].p50 / (step_ms / steps) if steps and lat["itl_ms"].p50 else None, 3),
            "messages_per_step": _r(messages / steps if steps else None),
            # With `stream_channel: step` the messages above stay in the replica; these are what Serve carries.
            "channel_messages_per_step": _r(channel_messages / steps if steps else None),
            "coalesced_share": _r(coalesced / (messages + coalesced) if messages + coalesced else None, 3),
            **{f"cpu_{role}": used for role, used in sorted(cores.items())}}


def point_processes(app: str, decode_stats: dict) -> dict[str, int]:
    """The processes a stream crosses: the engine (its own process, when it has one), the decode
    replica, the ingress replicas, Serve's proxies and this client."""
    pids = serve_processes(app)
    if decode_stats.get("pid") not in (None, decode_stats.get("replica_pid")):
        pids["engine"] = decode_stats["pid"]
    return {**pids, "client": os.getpid()}


def markdown(doc: dict) -> str:
    lines = [f"# Stream latency ({doc['machine'].get('gpu') or doc['machine']['cpu_model']})", "",
             f"`{doc['command']}` (commit {doc['commit']}); {doc['work']}", "", rows_table(doc["rows"]).rstrip("\n")]
    if doc["errors"]:
        lines += ["", "## Failures", ""] + [f"- {k}: {e}" for k, e in doc["errors"].items()]
    return "\n".join(lines) + "\n"


def write(doc: dict, out: Path, device: str) -> None:
    (out / f"stream_latency_{device}.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / f"stream_latency_{device}.md").write_text(markdown(doc))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", default="tinyllama-7b", help="cuda: the constructed pair's shape")
    parser.add_argument("--agreement", type=float, default=0.8, help="cuda: the constructed pair's agreement")
    parser.add_argument("--pair-dir", type=Path, default=Path("/tmp/vpd_gpu_modes"))
    parser.add_argument("--modes", default="nospec,spec")
    parser.add_argument("--settings", type=parse_settings, default=parse_settings(DEFAULT_SETTINGS))
    parser.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=None,
                        help="default 1,64,256 on cuda, 1,8 on cpu")
    parser.add_argument("--requests", type=lambda t: [int(x) for x in t.split(",")], default=None,
                        help="per concurrency; default 16,256,512 on cuda, 4,16 on cpu")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 on cuda, 32 on cpu")
    parser.add_argument("--output-len", type=int, default=None, help="default 128 on cuda, 32 on cpu")
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--budget-s", type=float, default=None, help="start no deployment after this long")
    parser.add_argument("--serve-throughput-optimized", action="store_true",
                        help="start Ray with RAY_SERVE_THROUGHPUT_OPTIMIZED=1: gRPC between replicas, user "
                        "code on the replica's event loop (Serve's proxy process still showed 1.5-1.7 cores "
                        "busy in benchmarks/results/stream_hops_h100/)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    for key, gpu, cpu in (("concurrency", [1, 64, 256], [1, 8]), ("requests", [16, 256, 512], [4, 16]),
                          ("prompt_len", 128, 32), ("output_len", 128, 32)):
        if getattr(args, key) is None:
            setattr(args, key, gpu if cuda else cpu)
    assert len(args.requests) == len(args.concurrency), "one --requests count per --concurrency"
    args.dtype = "bfloat16" if cuda else "float32"
    args.max_num_seqs = max(max(args.concurrency), 8)  # one deployment serves every concurrency
    args.lane_num_cpus = 1.0 if cuda else 0.25
    args.modes = args.modes.split(",")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started_s = time.monotonic()
    target = draft = None
    if args.device == "cuda":
        pair = save_pair(args.shape, args.agreement, args.pair_dir, dtype=args.dtype, device=args.device)
        target, draft = pair.target, pair.draft
    probe = AppConfig.model_validate(app_config("nospec", target, draft, args))
    vocab = AutoConfig.from_pretrained(probe.target.path).get_text_config().vocab_size
    top = max(args.concurrency)
    warmup = random_work(vocab, args.prompt_len, min(16, args.output_len), top, 2 * top, seed=1)
    doc = {"command": "python benchmarks/stream_latency.py " + " ".join(argv), "commit": git_commit(),
           "machine": machine(), "work": f"closed loops of {args.concurrency} in flight ({args.requests} requests), "
           f"prompts of {args.prompt_len} random tokens, {args.output_len} output tokens, greedy, ignore_eos, "
           f"L = {args.draft_len}, {args.dtype}, max_num_seqs {args.max_num_seqs}",
           "serve_throughput_optimized": args.serve_throughput_optimized, "rows": [], "errors": {}}
    port = start_cluster({**({"TRITON_INTERPRET": "0"} if args.device == "cuda" else {}),
                          **serve_env(args.serve_throughput_optimized)})
    try:
        for mode in args.modes:
            for name, interval_ms, rate, engine in args.settings:
                label = f"{mode}-{name}"
                if args.budget_s is not None and time.monotonic() - started_s > args.budget_s:
                    doc["errors"][label] = "skipped: --budget-s spent"
                    write(doc, args.out, args.device)
                    continue
                config = app_config(mode, target, draft, args)
                config.update(stream_interval_ms=interval_ms, max_stream_messages_per_s=rate)
                apply_overrides(config, engine)
                try:
                    log(f"{label}: deploying (stream_interval_ms {interval_ms:g}, max_stream_messages_per_s {rate})")
                    deploy(label, config, timeout_s=600)
                    asyncio.run(run_load(f"http://127.0.0.1:{port}/{label}", warmup.workload(), ClosedLoop(top),
                                         options=OPTIONS, timeout_s=args.request_timeout_s, progress=False))
                    for i, (concurrency, count) in enumerate(zip(args.concurrency, args.requests)):
                        # Prompts of their own per point: none reads another's prefix cache.
                        work = random_work(vocab, args.prompt_len, args.output_len, concurrency, count, seed=10 + i)
                        row = {"mode": mode, "setting": name, "interval_ms": interval_ms, "max_msgs_s": rate, **engine,
                               **load_point(label, port, work, concurrency, args.request_timeout_s)}
                        doc["rows"].append(row)
                        log(json.dumps(row))
                        write(doc, args.out, args.device)
                except Exception as exc:  # one setting failing leaves the others measured
                    doc["errors"][label] = repr(exc)
                    log(f"{label}: failed: {exc!r}")
                finally:
                    serve.delete(label)
                    free_device_memory()
                write(doc, args.out, args.device)
    finally:
        serve.shutdown()
        ray.shutdown()
    log("done")


if __name__ == "__main__":
    os.environ.setdefault("RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT", "1")
    main()
