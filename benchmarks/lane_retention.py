"""What pdv's lane replicas keep per request: tracemalloc between two request counts, on the CPU.

pdv's three replicas run in one process (benchmarks/lib/pdv_in_process.py: the app's own factories, Ray's
handles replaced by in-process ones that pickle every argument and result), on the tiny test pair. After a
warm-up, `--a` requests, a snapshot, `--b - --a` more, another snapshot: whatever grows between the two
with the number of requests is retained per request. Mixed prompts (10 % of 96 tokens, the rest 16),
`--out` tokens each, greedy, `--concurrency` at once. Prints the growth in bytes per request by file and
line, the object types that grew, the lanes' timeline events per kind, and every per-request container's
size after the requests drained (all 0 expected).

A GPU soak (benchmarks/lane_soak.py) shows a lane's RSS over time; this says which line holds the bytes.
It traced the soak's RSS slope to the lanes' timelines (docs/gpu_faults.md):

    OMP_NUM_THREADS=1 python benchmarks/lane_retention.py --timeline-age 5   # age bound inside the window
"""

import argparse
import asyncio
import collections
import gc
import os
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRITON_INTERPRET", "1")  # the lanes' Triton kernels on the CPU
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.lib.pdv_in_process import build_pdv, drive, per_request_state  # noqa: E402
from deployments.timeline import TIMELINE  # noqa: E402


def mixed_prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(96 if rng.random() < 0.1 else 16)] for _ in range(count)]


def timeline_sizes() -> dict[str, int]:
    return {kind: len(events) for kind, events in TIMELINE.since(0.0).items()}


def snapshot():
    gc.collect()
    types = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    return tracemalloc.take_snapshot(), types, timeline_sizes()


def report(before, after, requests: int, top: int) -> None:
    (snap_a, types_a, events_a), (snap_b, types_b, events_b) = before, after
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    snap_a, snap_b = snap_a.filter_traces(ignore), snap_b.filter_traces(ignore)
    total = sum(stat.size_diff for stat in snap_b.compare_to(snap_a, "filename"))
    print(f"\ntraced growth: {total / 1024:.1f} KiB = {total / requests:.0f} B a request")
    print("\nby line (B a request, blocks a request), growth over 1 KiB:")
    for stat in snap_b.compare_to(snap_a, "lineno")[:top]:
        if abs(stat.size_diff) >= 1024:
            frame = stat.traceback[0]
            print(f"{stat.size_diff / requests:8.1f} {stat.count_diff / requests:7.2f}  {frame.filename}:{frame.lineno}")
    print("\nobject types that grew (a request):")
    grown = sorted(((types_b[name] - types_a.get(name, 0), name) for name in types_b), reverse=True)[:top]
    for count, name in grown:
        if count > 0:
            print(f"{count / requests:8.3f}  {name}")
    print("\ntimeline events by kind (at a -> at b, a request):")
    for kind in sorted(events_b):
        print(f"  {kind:14s} {events_a.get(kind, 0):7d} -> {events_b[kind]:7d}  "
              f"({(events_b[kind] - events_a.get(kind, 0)) / requests:+.2f})")


async def main(args) -> None:
    from tests.tiny_pair import save_tiny_pair

    torch.set_num_threads(1)
    target, draft = save_tiny_pair(Path(tempfile.mkdtemp(prefix="vpd_retention_")))
    decode, prefill, verify = build_pdv(target, draft)  # in the event loop, as Serve builds a replica
    # A shared 2-core host stalls for seconds: a peer call that slow is a stall here, not a lost replica.
    import deployments.prefill_replica as prefill_replica
    prefill_replica.PEER_CALL_TIMEOUT_S = 300.0
    decode.engine.core.verifier.timeout_s = 300.0
    if args.timeline_age is not None:
        TIMELINE.max_age_s = args.timeline_age
    prompts = mixed_prompts(decode.engine.core.vocab_size, 4096, args.seed)

    def run(first: int, count: int):
        return drive(decode, prompts, first, count, args.concurrency, args.out)

    started = time.monotonic()
    await run(0, args.warm)
    print(f"warm-up: {args.warm} requests in {time.monotonic() - started:.1f} s", flush=True)
    tracemalloc.start(args.frames)
    await run(args.warm, args.a)
    before = snapshot()
    steps, started = decode.engine.num_steps, time.monotonic()
    await run(args.warm + args.a, args.b - args.a)
    after = snapshot()
    requests = args.b - args.a
    print(f"{requests} requests between the snapshots in {time.monotonic() - started:.1f} s, "
          f"{(decode.engine.num_steps - steps) / requests:.1f} decode steps a request", flush=True)
    report(before, after, requests, args.top)
    print("\nper-request containers after the requests drained (0 expected):")
    for name, size in per_request_state(decode, prefill, verify).items():
        print(f"  {name:24s} {size}")
    decode.engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warm", type=int, default=100, help="requests before tracing starts")
    parser.add_argument("--a", type=int, default=200, help="requests traced before the first snapshot")
    parser.add_argument("--b", type=int, default=1200, help="requests traced before the second snapshot")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=int, default=32, help="output tokens a request")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--frames", type=int, default=8, help="tracemalloc frames kept per allocation")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--timeline-age", type=float, default=None,
                        help="the timelines' age bound for this run, s (default: deployments/timeline.py's)")
    asyncio.run(main(parser.parse_args()))
