"""Soak: pdv on one GPU for 20 minutes at 70 % of its capacity, mixed prompt lengths; method: docs/gpu_faults.md.

    python3 benchmarks/lane_soak.py --dir /tmp/soak --detach       # starts it under setsid, returns at once
    python3 benchmarks/lane_soak.py --collect /tmp/soak --wait-s 560 --copy-to $OUT   # waits, then tables
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lane_soak.py --dir /tmp/soak --shape small --device cpu \\
        --duration-s 120                                               (CPU dry run, in the foreground)

The soak writes status.json, records.jsonl (a line per request as it ends), memory.csv and soak.log under
--dir as it goes; --collect writes soak.md (a row per minute, the goals), soak.json and soak.png from them,
finished or not, and --copy-to copies those and the raw files (records gzipped) to a folder.
"""

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pandas as pd
import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.apps import deploy_warm, last_point, pair_and_cluster, run_loads, sized_args  # noqa: E402
from benchmarks.lib.cluster import git_commit, log, machine  # noqa: E402
from benchmarks.lib.loads import MIXED, Load, mixed_requests  # noqa: E402
from benchmarks.lib.results import rounded, script_parser  # noqa: E402
from loadtest import soak as minutes_of  # noqa: E402
from loadtest.arrivals import ClosedLoop, OpenLoop  # noqa: E402
from loadtest.memory import MemorySamples, sample_memory, write_memory  # noqa: E402
from loadtest.runner import run_load  # noqa: E402

# By device; every key is also a flag. The GPU's: pdv-1gpu.yaml's 64 decode slots, a context that
# takes MIXED's 3,000-token prompts. The CPU's only prove the path.
SIZES = {
    "cuda": dict(duration_s=1200.0, rate_factor=0.7, capacity_concurrency=64, capacity_requests=256,
                 max_num_seqs=64, max_model_len=4096, pool_size=4096, sample_s=10.0, request_timeout_s=120.0),
    "cpu": dict(duration_s=120.0, rate_factor=0.7, capacity_concurrency=8, capacity_requests=16,
                max_num_seqs=8, max_model_len=512, pool_size=256, sample_s=5.0, request_timeout_s=120.0),
}
FLUSH_S = 15.0
DONE_PHASES = ("done", "failed")
# What --copy-to takes (a device call brings back at most 8 files), besides records.jsonl.gz.
COPIED = ("soak.md", "soak.json", "soak.png", "memory.png", "memory.csv", "status.json", "soak.log")


def read_status(directory: Path) -> dict:
    path = directory / "status.json"
    return json.loads(path.read_text()) if path.exists() else {"phase": "not started"}


def write_status(directory: Path, status: dict, **changes) -> None:
    """status.json, replaced whole (a reader never sees half of it)."""
    status.update(changes, updated_wall_s=round(time.time(), 1))
    tmp = directory / "status.json.tmp"
    tmp.write_text(json.dumps(status, indent=1, default=str))
    tmp.replace(directory / "status.json")


def alive(pid: int | None) -> bool:
    with contextlib.suppress(TypeError, OSError):
        os.kill(pid, 0)
        return True
    return False


def soak(args: argparse.Namespace) -> None:
    """Pair, cluster, pdv and its warm-up, its capacity on mixed traffic, then the soak at a share of it."""
    sizes, directory, mixed = args.sizes, args.dir, MIXED[args.device]
    status = {"command": "python3 benchmarks/lane_soak.py " + " ".join(args.argv), "pid": os.getpid(),
              "commit": git_commit(), "machine": machine(), "device": args.device, "sizes": sizes,
              "mixed": mixed, "duration_s": sizes["duration_s"]}
    write_status(directory, status, phase="setup")
    try:
        pair, tokenizer, port = pair_and_cluster(args)
        status["pair"] = {"shape": args.shape, "agreement": args.agreement, "dtype": args.dtype, "check": pair.check}
        run, status["config"] = deploy_warm("pdv", args, pair, tokenizer, port, time.monotonic() + 1800,
                                            mixed["prompt"], long_prompts=2, long_prompt_len=mixed["long"])
        if run.status == "failed":
            raise RuntimeError(f"deploy: {run.error}\n{run.replica_logs}")
        write_status(directory, status, phase="capacity", deploy_s=round(run.deploy_s, 1))
        capacity = Load("capacity", mixed_requests(tokenizer, sizes["capacity_requests"], args.seed + 3, args.device),
                        ClosedLoop(sizes["capacity_concurrency"]))
        run_loads(run, port, [capacity], time.monotonic() + 1800, request_timeout_s=sizes["request_timeout_s"],
                  seed=args.seed)
        measured = last_point(run, capacity)
        if measured is None or measured.summary.request_throughput_rps <= 0:
            raise RuntimeError(f"no capacity measured: {run.error or run.skipped}")
        rate_rps = sizes["rate_factor"] * measured.summary.request_throughput_rps
        status["capacity"] = {"concurrency": sizes["capacity_concurrency"], **rounded(measured.summary.to_dict())}
        pool = mixed_requests(tokenizer, sizes["pool_size"], args.seed + 11, args.device)
        log(f"capacity {measured.summary.request_throughput_rps:.2f} requests/s; soak at {rate_rps:.2f} requests/s "
            f"for {sizes['duration_s']:.0f} s")
        asyncio.run(soak_load(f"http://127.0.0.1:{port}/pdv", pool, rate_rps, args.seed, directory, status, sizes))
        write_status(directory, status, phase="done")
    except BaseException as exc:
        write_status(directory, status, phase="failed", error=f"{type(exc).__name__}: {exc}",
                     traceback=traceback.format_exc()[-4000:])
        raise
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    collect(directory)


async def soak_load(url: str, pool, rate_rps: float, seed: int, directory: Path, status: dict, sizes: dict) -> None:
    """Poisson arrivals for duration_s, each record appended to records.jsonl as it ends, memory sampled
    every sample_s (loadtest/memory.py) and written with status.json every FLUSH_S."""
    samples, stop = MemorySamples(), asyncio.Event()
    origin_wall_s = time.time()
    write_status(directory, status, phase="soak", origin_wall_s=origin_wall_s, rate_rps=round(rate_rps, 3))
    sampler = asyncio.create_task(sample_memory(url, sizes["sample_s"], samples, stop))

    async def flush() -> None:
        while not stop.is_set():
            samples.frame().to_csv(directory / "memory.csv", index=False)
            write_status(directory, status, elapsed_s=round(time.time() - origin_wall_s, 1))
            with contextlib.suppress(asyncio.TimeoutError):  # FLUSH_S passed
                await asyncio.wait_for(stop.wait(), FLUSH_S)

    flusher = asyncio.create_task(flush())
    with (directory / "records.jsonl").open("a") as records:
        def on_record(record) -> None:
            records.write(json.dumps(minutes_of.record_row(record, origin_wall_s)) + "\n")
            records.flush()

        try:
            result = await run_load(url, pool, OpenLoop(rate_rps), duration_s=sizes["duration_s"],
                                    timeout_s=sizes["request_timeout_s"], seed=seed, progress=False,
                                    on_record=on_record)
        finally:
            stop.set()
            await asyncio.gather(sampler, flusher)
    status["totals"] = rounded(result.summary().to_dict())
    # memory.csv whole, memory.png and each process's growth from the end of the warm-up on
    status["memory_growth"] = write_memory(directory, samples, warmup_s=minutes_of.FIRST_MINUTE * 60.0)


def collect(directory: Path, copy_to: Path | None = None, wait_s: float = 0.0) -> None:
    """soak.md / soak.json / soak.png from what the soak wrote so far, once it has ended (or its process is
    gone) or after `wait_s`."""
    deadline_s, status = time.monotonic() + wait_s, read_status(directory)
    while status["phase"] not in DONE_PHASES and alive(status.get("pid")) and time.monotonic() < deadline_s:
        time.sleep(5)
        status = read_status(directory)
    if status["phase"] not in DONE_PHASES and not alive(status.get("pid")):
        status["phase"] += " (its process is gone)"
    # How far it got: all of it once done; while it runs, until now; else (failed, gone) its last flush.
    elapsed_s = (None if status["phase"] == "done" else time.time() - status["origin_wall_s"]
                 if status["phase"] == "soak" else status.get("elapsed_s", 0.0))
    records = minutes_of.read_records(directory / "records.jsonl")
    memory_path = directory / "memory.csv"
    memory = pd.read_csv(memory_path) if memory_path.exists() and memory_path.stat().st_size else pd.DataFrame()
    duration_s, capacity = status.get("duration_s", 0.0), status.get("capacity") or {}
    rows = minutes_of.minutes(records, memory, duration_s, elapsed_s) if status.get("origin_wall_s") else []
    checks = minutes_of.goals(rows) if rows else []
    header = (f"# pdv soak ({status.get('device')}): {status['phase']}\n\n`{status.get('command')}` at "
              f"{status.get('commit')}; {(status.get('machine') or {}).get('gpu') or 'no GPU'}. Capacity (closed "
              f"loop of {capacity.get('concurrency')}): {capacity.get('request_throughput_rps')} requests/s, "
              f"{capacity.get('output_token_throughput_tps')} tok/s; soak at {status.get('rate_rps')} requests/s for "
              f"{duration_s:g} s{'' if elapsed_s is None else f' ({elapsed_s:.0f} s so far)'}; {len(records)} "
              "requests ended, each counted in the minute it ended; memory: each lane's processes summed, the "
              "minute's mean (loadtest/soak.py).\n" + (f"\nFailed: {status['error']}\n" if status.get("error") else ""))
    (directory / "soak.json").write_text(json.dumps({"status": status, "minutes": rows, "goals": checks}, indent=1,
                                                    default=str))
    (directory / "soak.md").write_text(minutes_of.markdown(rows, checks, header) if rows else header)
    minutes_of.plot(rows, directory / "soak.png")
    print((directory / "soak.md").read_text(), flush=True)
    if copy_to is not None:
        copy_to.mkdir(parents=True, exist_ok=True)
        for name in (n for n in COPIED if (directory / n).exists()):
            shutil.copy(directory / name, copy_to / name)
        if (records_path := directory / "records.jsonl").exists():
            with records_path.open("rb") as raw, gzip.open(copy_to / "records.jsonl.gz", "wb") as packed:
                shutil.copyfileobj(raw, packed)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = script_parser(__doc__, budget_s=None, out=False, pair=True)
    parser.add_argument("--dir", type=Path, help="where the soak writes as it goes (not $OUT: emptied every call)")
    parser.add_argument("--detach", action="store_true", help="run under setsid, output to DIR/soak.log; return")
    parser.add_argument("--collect", type=Path, metavar="DIR", help="tables and plots from DIR, finished or not")
    parser.add_argument("--wait-s", type=float, default=0.0, help="--collect: wait this long for the soak's end")
    parser.add_argument("--copy-to", type=Path, default=None, help="--collect: copy the results here too")
    args = sized_args(parser, SIZES, argv)
    if (args.dir is None) == (args.collect is None):
        parser.error("give --dir (run a soak) or --collect DIR")
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.collect is not None:
        return collect(args.collect, args.copy_to, args.wait_s)
    args.dir.mkdir(parents=True, exist_ok=True)
    if read_status(args.dir).get("pid", os.getpid()) != os.getpid():  # (--detach's child finds its own)
        raise SystemExit(f"{args.dir} holds a soak already (status.json): give another --dir")
    if not args.detach:
        return soak(args)
    with (args.dir / "soak.log").open("ab") as log_file:
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *(a for a in argv if a != "--detach")],
                                 stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                 start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    write_status(args.dir, {"pid": child.pid, "duration_s": args.sizes["duration_s"]}, phase="starting")
    print(f"soak started under setsid: pid {child.pid}; log {args.dir / 'soak.log'}", flush=True)


if __name__ == "__main__":
    main()
