"""Soak: pdv on one GPU for 20 minutes at 70 % of its capacity, mixed prompt lengths.

    python3 benchmarks/lane_soak.py --dir /tmp/soak --detach       # starts it under setsid, returns at once
    python3 benchmarks/lane_soak.py --collect /tmp/soak --wait-s 560 --copy-to $OUT
                                   # waits until it ends or 560 s pass, then tables and plots what is there
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lane_soak.py --dir /tmp/soak --shape small --device cpu \\
        --duration-s 120                                               (CPU dry run, in the foreground)

A device call lasts at most 10 minutes, so the soak runs detached (a new session: it outlives the
call while the machine stays warm) and writes as it goes under --dir: status.json (the phase, the
capacity and rate, when the soak began), records.jsonl (a line per request as it ends), memory.csv
(every 15 s) and soak.log. `--collect` reads them, finished or not, and writes soak.md (a row per
minute, the goals), soak.json and soak.png; `--copy-to` copies those and the raw files to a folder
that comes back ($OUT: emptied before every call, so the soak itself writes elsewhere).

The run, on the constructed Llama-2-7B / TinyLlama pair at agreement 0.8 (benchmarks/lib/pairs.py),
pdv deployed as configs/pdv.yaml with configs/pdv-1gpu.yaml's lane shares (benchmarks/lib/apps.py):
  1. warm-up: a burst of max_num_seqs requests, two of them long (CUDA graphs, long prefills);
  2. capacity: a closed loop of --capacity-concurrency (max_num_seqs) mixed requests; its completed
     requests/s is pdv's capacity on this traffic;
  3. the soak: Poisson arrivals at --rate-factor (0.7) x capacity for --duration-s, mixed traffic
     (benchmarks/lib/loads.py MIXED: 10 % of prompts 3,000 tokens, the rest 128; 128 out; greedy,
     ignore_eos), the load tester's own client (loadtest.runner.run_load), every request recorded;
     every --sample-s the load tester's memory sampler (loadtest/memory.py) reads each lane process's
     RSS and GPU memory (NVML) and the whole GPU's use.
Minutes, goals (0 failed; memory and p99 TPOT flat from minute 2 to the last, +2 % and +10 %) and
their definitions: loadtest/soak.py. The request pool (--pool-size distinct requests) is cycled.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # replicas inherit it: kernels compile for the GPU

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import pandas as pd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from loadtest import soak as minutes_of  # noqa: E402
from loadtest.arrivals import ClosedLoop, OpenLoop  # noqa: E402
from loadtest.memory import MemorySamples, sample_memory, write_memory  # noqa: E402
from loadtest.runner import run_load  # noqa: E402
from loadtest.workload import LogNormal, load_tokenizer  # noqa: E402

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
# What --copy-to takes (a device call brings back at most 8 files, 16 MiB each): records.jsonl
# gzipped (at 20 requests/s, 24,000 lines of ~500 bytes).
COPIED = ("soak.md", "soak.json", "soak.png", "memory.png", "memory.csv", "status.json", "soak.log")


# ---- the files under --dir -----------------------------------------------------------------------

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
    try:
        os.kill(pid, 0)
    except (TypeError, OSError):
        return False
    return True


# ---- the run (detached on the device) -----------------------------------------------------------

def soak(args: argparse.Namespace) -> None:
    """Pair, cluster, pdv, warm-up, capacity, the soak (module docstring); status.json says where."""
    # Imported here, not above: --collect and --detach need neither Ray nor torch.
    import ray
    from ray import serve

    from benchmarks.lib.apps import PRESETS, AppRun, app_args, deploy_app, engine_args, last_point, run_loads
    from benchmarks.lib.cluster import git_commit, log, machine, start_cluster
    from benchmarks.lib.loads import MIXED, Load, mixed_requests, warmup_requests
    from benchmarks.lib.pairs import save_pair

    sizes, directory = args.sizes, args.dir
    status = {"command": "python3 benchmarks/lane_soak.py " + " ".join(args.argv), "pid": os.getpid(),
              "commit": git_commit(), "machine": machine(), "device": args.device, "sizes": sizes,
              "mixed": MIXED[args.device], "duration_s": sizes["duration_s"]}
    write_status(directory, status, phase="pair")
    try:
        dtype = PRESETS[args.device]["dtype"]
        pair = save_pair(args.shape, args.agreement, args.pair_dir, dtype=dtype, device=args.device, seed=args.seed)
        tokenizer = load_tokenizer(pair.target)
        status["pair"] = {"shape": args.shape, "agreement": args.agreement, "dtype": dtype, "check": pair.check}
        write_status(directory, status, phase="deploy")
        port = start_cluster({"TOKENIZERS_PARALLELISM": "false",
                              "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0")})
        config = app_args("pdv", pair.target, pair.draft, dtype=dtype,
                          engine=engine_args(sizes["max_model_len"], sizes["max_num_seqs"]),
                          lane_num_cpus=PRESETS[args.device]["lane_num_cpus"], one_gpu=args.device == "cuda")
        status["config"] = config
        run = AppRun("pdv")
        if not deploy_app(run, config, PRESETS[args.device]["deploy_timeout_s"]):
            raise RuntimeError(f"deploy: {run.error}\n{run.replica_logs}")
        url = f"http://127.0.0.1:{port}/pdv"
        write_status(directory, status, phase="capacity", deploy_s=round(run.deploy_s, 1))
        prompts = LogNormal(MIXED[args.device]["prompt"], 0.6, 4, 3 * MIXED[args.device]["prompt"])
        warm = Load("warmup", warmup_requests(tokenizer, sizes["max_num_seqs"], args.seed + 7, prompts, 2,
                                              MIXED[args.device]["long"]), OpenLoop(math.inf), measured=False)
        capacity = Load("capacity", mixed_requests(tokenizer, sizes["capacity_requests"], args.seed + 3, args.device),
                        ClosedLoop(sizes["capacity_concurrency"]))
        run_loads(run, port, [warm, capacity], time.monotonic() + 1800, request_timeout_s=sizes["request_timeout_s"],
                  seed=args.seed)
        measured = last_point(run, capacity)
        if measured is None or measured.summary.request_throughput_rps <= 0:
            raise RuntimeError(f"no capacity measured: {run.error or run.skipped}")
        s = measured.summary
        rate_rps = sizes["rate_factor"] * s.request_throughput_rps
        status["capacity"] = {"concurrency": sizes["capacity_concurrency"], "submitted": s.submitted,
                              "completed": s.completed, "failed": s.failed, "timed_out": s.timed_out,
                              "request_throughput_rps": round(s.request_throughput_rps, 3),
                              "output_token_throughput_tps": round(s.output_token_throughput_tps, 1),
                              "tpot_ms_p99": s.latency_ms["tpot_ms"].p99, "wall_s": round(s.wall_s, 1)}
        pool = mixed_requests(tokenizer, sizes["pool_size"], args.seed + 11, args.device)
        log(f"capacity {s.request_throughput_rps:.2f} requests/s ({s.completed}/{s.submitted} completed); "
            f"soak at {rate_rps:.2f} requests/s for {sizes['duration_s']:.0f} s")
        asyncio.run(soak_load(url, pool, rate_rps, sizes, args.seed, directory, status))
        write_status(directory, status, phase="writing")
        samples = MemorySamples(pd.read_csv(directory / "memory.csv").to_dict("records"))
        status["memory_growth"] = write_memory(directory, samples, warmup_s=minutes_of.FIRST_MINUTE * 60.0)
        write_status(directory, status, phase="done")
        log("soak done")
    except BaseException as exc:
        write_status(directory, status, phase="failed", error=f"{type(exc).__name__}: {exc}",
                     traceback=traceback.format_exc()[-4000:])
        raise
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    collect(directory)


async def soak_load(url: str, pool, rate_rps: float, sizes: dict, seed: int, directory: Path, status: dict) -> None:
    """The soak itself: Poisson arrivals for duration_s, each record appended to records.jsonl as it
    ends, memory sampled every sample_s and written with status.json every FLUSH_S."""
    samples, stop = MemorySamples(), asyncio.Event()
    origin_wall_s = time.time()
    write_status(directory, status, phase="soak", origin_wall_s=origin_wall_s, rate_rps=round(rate_rps, 3))
    sampler = asyncio.create_task(sample_memory(url, sizes["sample_s"], samples, stop))

    async def flush() -> None:
        while not stop.is_set():
            samples.frame().to_csv(directory / "memory.csv", index=False)
            write_status(directory, status, elapsed_s=round(time.time() - origin_wall_s, 1))
            try:
                await asyncio.wait_for(stop.wait(), FLUSH_S)
            except asyncio.TimeoutError:
                pass

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
    samples.frame().to_csv(directory / "memory.csv", index=False)
    s = result.summary()
    status["totals"] = {"submitted": s.submitted, "completed": s.completed, "failed": s.failed,
                        "timed_out": s.timed_out, "wall_s": round(s.wall_s, 1),
                        "output_token_throughput_tps": round(s.output_token_throughput_tps, 1),
                        "tpot_ms_p99": s.latency_ms["tpot_ms"].p99}


# ---- collect (any time, on the device or here) -------------------------------------------------

def wait_for_end(directory: Path, wait_s: float) -> dict:
    """Until the soak ends (or its process is gone) or `wait_s` passes, a progress line a minute."""
    deadline_s, last_line_s = time.monotonic() + wait_s, 0.0
    while True:
        status = read_status(directory)
        gone = status["phase"] not in DONE_PHASES and not alive(status.get("pid"))
        if status["phase"] in DONE_PHASES or gone or time.monotonic() >= deadline_s:
            return status
        if time.monotonic() - last_line_s >= 60:
            lines = (directory / "records.jsonl").read_text().count("\n") if (directory / "records.jsonl").exists() else 0
            print(f"[collect] phase {status['phase']}, {status.get('elapsed_s', 0):.0f} of "
                  f"{status.get('duration_s', 0):.0f} s, {lines} requests ended", flush=True)
            last_line_s = time.monotonic()
        time.sleep(5)


def collect(directory: Path, copy_to: Path | None = None, wait_s: float = 0.0) -> None:
    """soak.md / soak.json / soak.png from what the soak wrote so far (module docstring)."""
    status = wait_for_end(directory, wait_s)
    records = minutes_of.read_records(directory / "records.jsonl")
    memory_path = directory / "memory.csv"
    memory = pd.read_csv(memory_path) if memory_path.exists() and memory_path.stat().st_size else pd.DataFrame()
    duration_s = status.get("duration_s", 0.0)
    origin = status.get("origin_wall_s")
    if status["phase"] in ("writing", "done"):
        elapsed_s = None  # the whole duration
    elif status["phase"] == "soak" and alive(status.get("pid")):
        elapsed_s = time.time() - origin
    else:  # failed, or gone: as far as its last flush
        elapsed_s = status.get("elapsed_s", 0.0)
    if status["phase"] not in DONE_PHASES and not alive(status.get("pid")):
        status["phase"] += " (its process is gone)"
    rows = minutes_of.minutes(records, memory, duration_s, elapsed_s) if origin else []
    checks = minutes_of.goals(rows) if rows else []
    capacity = status.get("capacity") or {}
    header = (f"# pdv soak ({status.get('device')}): {status['phase']}\n\n`{status.get('command')}` at "
              f"{status.get('commit')}; {(status.get('machine') or {}).get('gpu') or 'no GPU'}. Capacity (closed loop of "
              f"{capacity.get('concurrency')}): {capacity.get('request_throughput_rps')} requests/s, "
              f"{capacity.get('output_token_throughput_tps')} tok/s; soak at {status.get('rate_rps')} requests/s for "
              f"{duration_s:g} s{'' if elapsed_s is None else f' ({elapsed_s:.0f} s so far)'}; "
              f"{len(records)} requests ended. Requests count in the minute they ended; memory is each lane's "
              "processes summed, the minute's mean (loadtest/soak.py).\n")
    if status.get("error"):
        header += f"\nFailed: {status['error']}\n"
    document = {"status": status, "minutes": rows, "goals": checks}
    (directory / "soak.json").write_text(json.dumps(document, indent=1, default=str))
    (directory / "soak.md").write_text(minutes_of.markdown(rows, checks, header) if rows else header)
    minutes_of.plot(rows, directory / "soak.png")
    print((directory / "soak.md").read_text(), flush=True)
    if copy_to is not None:
        copy_to.mkdir(parents=True, exist_ok=True)
        for name in COPIED:
            if (directory / name).exists():
                shutil.copy(directory / name, copy_to / name)
        if (directory / "records.jsonl").exists():
            with (directory / "records.jsonl").open("rb") as raw, gzip.open(copy_to / "records.jsonl.gz", "wb") as packed:
                shutil.copyfileobj(raw, packed)


# ---- main --------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, help="where the soak writes as it goes (not $OUT: emptied every call)")
    parser.add_argument("--detach", action="store_true", help="run under setsid, output to DIR/soak.log; return")
    parser.add_argument("--collect", type=Path, metavar="DIR", help="tables and plots from DIR, finished or not")
    parser.add_argument("--wait-s", type=float, default=0.0, help="--collect: wait this long for the soak's end")
    parser.add_argument("--copy-to", type=Path, default=None, help="--collect: copy the results here too")
    parser.add_argument("--shape", choices=("tinyllama-7b", "small"), default="tinyllama-7b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--agreement", type=float, default=0.8)
    parser.add_argument("--pair-dir", type=Path, default=Path("/tmp/vpd_gpu_modes"),
                        help="saved constructed pairs (benchmarks/lib/pairs.py; a finished save is reused)")
    parser.add_argument("--seed", type=int, default=0)
    for key, value in SIZES["cuda"].items():
        parser.add_argument("--" + key.replace("_", "-"), type=type(value), default=None,
                            help=f"default {value} on cuda, {SIZES['cpu'][key]} on cpu")
    args = parser.parse_args(argv)
    if (args.dir is None) == (args.collect is None):
        parser.error("give --dir (run a soak) or --collect DIR")
    args.sizes = {key: SIZES[args.device][key] if getattr(args, key) is None else getattr(args, key)
                  for key in SIZES["cuda"]}
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.collect is not None:
        collect(args.collect, args.copy_to, args.wait_s)
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    if read_status(args.dir).get("pid", os.getpid()) != os.getpid():  # (--detach's child finds its own)
        raise SystemExit(f"{args.dir} holds a soak already (status.json): give another --dir")
    if args.detach:
        with (args.dir / "soak.log").open("ab") as log_file:
            child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *(a for a in argv if a != "--detach")],
                                     stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        write_status(args.dir, {"pid": child.pid, "duration_s": args.sizes["duration_s"]}, phase="starting")
        print(f"soak started under setsid: pid {child.pid}; log {args.dir / 'soak.log'}", flush=True)
        return
    soak(args)


if __name__ == "__main__":
    main()
