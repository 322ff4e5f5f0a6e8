"""What a streaming client sees under each stream-coalescing setting, through Serve's proxy and the OpenAI
ingress (docs/serving.md, HTTP API): one deployment per setting, loaded at each --concurrency.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stream_latency.py --device cpu --modes nospec --out /tmp/sl
    python3 benchmarks/stream_latency.py --device cuda --modes nospec --serve-throughput-optimized \\
        --settings 'every_step:0:0,wide:0:0:ingress.num_replicas=4,step:0:0:stream_channel="step"' --out OUT

--settings: NAME:STREAM_INTERVAL_MS:MAX_STREAM_MESSAGES_PER_S[:KEY=JSON...] (0: no bound), KEY an app config
key, a dotted path into it, or an engine key. Per point (a closed loop of random token-id prompts): tok/s,
ITL, TPOT, TTFT, the decode stall, the decode replica's steps and stream messages per step, and the cores of
each process on the stream's path (`cpu_<role>`). Writes stream_latency_<device>.json and .md under --out.
"""

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from ray import serve
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.apps import PRESETS, app_args, engine_args, sized_args  # noqa: E402
from benchmarks.lib.cluster import (deploy, free_device_memory, git_commit, log, machine, serve_env,  # noqa: E402
                                    serving, start_cluster)
from benchmarks.lib.loads import decode_stall_ms  # noqa: E402
from benchmarks.lib.pairs import save_pair  # noqa: E402
from benchmarks.lib.proc_cpu import CpuMeter, serve_processes  # noqa: E402
from benchmarks.lib.results import rounded, rows_table, script_parser, write_document  # noqa: E402
from deployments.config import DEFAULT_TARGET, AppConfig  # noqa: E402
from lanes.engine.step_profile import StepProfile  # noqa: E402
from loadtest.arrivals import ClosedLoop  # noqa: E402
from loadtest.client import RequestOptions  # noqa: E402
from loadtest.report import Point  # noqa: E402
from loadtest.runner import run_load  # noqa: E402
from loadtest.workload import WorkloadRequest  # noqa: E402

DEFAULT_SETTINGS = "old:50:400,every_step:0:0"
OPTIONS = RequestOptions(endpoint="completions", temperature=0.0, ignore_eos=True)
COUNTERS = ("num_steps", "step_ms_total", "num_messages", "channel_messages", "num_coalesced")
# By device; every key is also a flag (--requests: a count per --concurrency).
SIZES = {"cuda": dict(concurrency=[1, 64, 256], requests=[16, 256, 512], prompt_len=128, output_len=128),
         "cpu": dict(concurrency=[1, 8], requests=[4, 16], prompt_len=32, output_len=32)}


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
        *path, last = key.split(".") if "." in key or key in AppConfig.model_fields else ("engine", key)
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value


def _per(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def random_requests(vocab_size: int, prompt_len: int, output_len: int, count: int, seed: int) -> list[WorkloadRequest]:
    """Prompts of random token ids, sent as ids: no tokenizer in the way."""
    prompts = np.random.default_rng(seed).integers(1, vocab_size, (count, prompt_len)).tolist()
    return [WorkloadRequest(p, prompt_len, output_len) for p in prompts]  # type: ignore[arg-type]


def load_point(name: str, port: int, work: list[WorkloadRequest], concurrency: int, timeout_s: float) -> dict:
    """One closed loop against app `name`, and what its decode replica (the app's one) counted meanwhile."""
    handle = serve.get_deployment_handle("DecodeLane", app_name=name)
    before = handle.stats.remote().result()
    # The processes a stream crosses: the engine (in a process of its own, when it is), the decode replica,
    # the ingress replicas, Serve's proxies and this client.
    pids = {**serve_processes(name), "client": os.getpid()}
    if before.get("pid") not in (None, before.get("replica_pid")):
        pids["engine"] = before["pid"]
    meter = CpuMeter(pids).start()
    result = asyncio.run(run_load(f"http://127.0.0.1:{port}/{name}", work, ClosedLoop(concurrency),
                                  options=OPTIONS, timeout_s=timeout_s, progress=False))
    cores = meter.stop()
    after = handle.stats.remote().result()
    steps, step_ms, messages, channel_messages, coalesced = (after.get(k, 0) - before.get(k, 0) for k in COUNTERS)
    profile = StepProfile(**after["step_profile"]).since(StepProfile(**before["step_profile"])).summary()
    s = result.summary()
    itl, tpot = s.latency_ms["itl_ms"], s.latency_ms["tpot_ms"]
    return rounded({
        "concurrency": concurrency, "submitted": s.submitted, "completed": s.completed, "failed": s.failed,
        "timed_out": s.timed_out, "output_tok_s": s.output_token_throughput_tps, "itl_p50_ms": itl.p50,
        "itl_p99_ms": itl.p99, "tpot_p50_ms": tpot.p50, "tpot_p99_ms": tpot.p99,
        "stall_p99_ms": decode_stall_ms(Point(name, result, s)), "ttft_p50_ms": s.latency_ms["ttft_ms"].p50,
        "step_ms_mean": _per(step_ms, steps), "decode_step_ms": profile.get("decode_only_step_ms"),
        "itl_p50_over_step": _per(itl.p50, _per(step_ms, steps)), "messages_per_step": _per(messages, steps),
        # With `stream_channel: step` the messages above stay in the replica; these are what Serve carries.
        "channel_messages_per_step": _per(channel_messages, steps),
        "coalesced_share": _per(coalesced, messages + coalesced),
        **{f"cpu_{role}": used for role, used in sorted(cores.items())}})


def write(doc: dict, out: Path, device: str) -> None:
    lines = [f"# Stream latency ({doc['machine'].get('gpu') or doc['machine']['cpu_model']})", "",
             f"`{doc['command']}` (commit {doc['commit']}); {doc['work']}", "", rows_table(doc["rows"]).rstrip("\n")]
    if doc["errors"]:
        lines += ["", "## Failures", ""] + [f"- {k}: {e}" for k, e in doc["errors"].items()]
    write_document(out, f"stream_latency_{device}", doc, "\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = script_parser(__doc__, budget_s=None)  # --device, --out, --budget-s (no deploy after it), --pair-dir
    parser.set_defaults(device="cpu")
    parser.add_argument("--shape", default="tinyllama-7b", help="cuda: the constructed pair's shape")
    parser.add_argument("--agreement", type=float, default=0.8, help="cuda: the constructed pair's agreement")
    parser.add_argument("--modes", default="nospec,spec")
    parser.add_argument("--settings", type=parse_settings, default=parse_settings(DEFAULT_SETTINGS))
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--serve-throughput-optimized", action="store_true",
                        help="start Ray with RAY_SERVE_THROUGHPUT_OPTIMIZED=1: gRPC between replicas, user "
                        "code on the replica's event loop")
    args = sized_args(parser, SIZES, argv)  # and the dtype: PRESETS'
    assert len(args.requests) == len(args.concurrency), "one --requests count per --concurrency"
    args.lane_num_cpus = PRESETS[args.device]["lane_num_cpus"]
    args.max_num_seqs = max(max(args.concurrency), 8)  # one deployment serves every concurrency
    args.modes = args.modes.split(",")
    return args


def run_setting(doc: dict, label: str, labels: dict, config: dict, port: int, vocab: int, warmup, args) -> None:
    """Deploy `config` as app `label`, warm it up, a point per concurrency (a row each in doc, `labels`
    first), delete it."""
    deploy(label, config, timeout_s=600)
    try:
        asyncio.run(run_load(f"http://127.0.0.1:{port}/{label}", warmup, ClosedLoop(max(args.concurrency)),
                             options=OPTIONS, timeout_s=args.request_timeout_s, progress=False))
        for i, (concurrency, count) in enumerate(zip(args.concurrency, args.requests)):
            # Prompts of their own per point: none reads another's prefix cache.
            work = random_requests(vocab, args.prompt_len, args.output_len, count, seed=10 + i)
            doc["rows"].append({**labels, **load_point(label, port, work, concurrency, args.request_timeout_s)})
            log(json.dumps(doc["rows"][-1]))
            write(doc, args.out, args.device)
    finally:
        serve.delete(label)
        free_device_memory()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started_s = time.monotonic()
    target = draft = None  # the shipped pair on the CPU
    if args.device == "cuda":
        pair = save_pair(args.shape, args.agreement, args.pair_dir, dtype=args.dtype, device=args.device)
        target, draft = pair.target, pair.draft
    engine = engine_args(args.prompt_len + args.output_len + 64, args.max_num_seqs, args.draft_len)
    vocab = AutoConfig.from_pretrained(target or DEFAULT_TARGET).get_text_config().vocab_size
    warmup = random_requests(vocab, args.prompt_len, min(16, args.output_len), 2 * max(args.concurrency), seed=1)
    doc = {"command": "python benchmarks/stream_latency.py " + " ".join(argv), "commit": git_commit(),
           "machine": machine(), "work": f"closed loops of {args.concurrency} in flight ({args.requests} requests), "
           f"prompts of {args.prompt_len} random tokens, {args.output_len} output tokens, greedy, ignore_eos, "
           f"L = {args.draft_len}, {args.dtype}, max_num_seqs {args.max_num_seqs}",
           "serve_throughput_optimized": args.serve_throughput_optimized, "rows": [], "errors": {}}
    env = {**({"TRITON_INTERPRET": "0"} if args.device == "cuda" else {}), **serve_env(args.serve_throughput_optimized)}
    with serving(start_cluster(env)) as port:
        for mode in args.modes:
            for name, interval_ms, rate, overrides in args.settings:
                label = f"{mode}-{name}"
                if args.budget_s is not None and time.monotonic() - started_s > args.budget_s:
                    doc["errors"][label] = "skipped: --budget-s spent"
                    log(f"{label}: skipped, --budget-s spent")
                    write(doc, args.out, args.device)
                    continue
                config = app_args(mode, target, draft, dtype=args.dtype, engine=engine,
                                  lane_num_cpus=args.lane_num_cpus, one_gpu=args.device == "cuda")
                config.update(stream_interval_ms=interval_ms, max_stream_messages_per_s=rate)
                apply_overrides(config, overrides)
                labels = {"mode": mode, "setting": name, "interval_ms": interval_ms, "max_msgs_s": rate, **overrides}
                log(f"{label}: deploying (stream_interval_ms {interval_ms:g}, max_stream_messages_per_s {rate})")
                try:
                    run_setting(doc, label, labels, config, port, vocab, warmup, args)
                except Exception as exc:  # one setting failing leaves the others measured
                    doc["errors"][label] = repr(exc)
                    log(f"{label}: failed: {exc!r}")
                write(doc, args.out, args.device)
    log("done")


if __name__ == "__main__":
    os.environ.setdefault("RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT", "1")
    main()
