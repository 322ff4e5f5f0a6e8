"""What one streamed chunk costs the OpenAI ingress: its process's CPU seconds per chunk its clients read.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ingress_cpu.py --out /tmp/ingress_cpu     (CPU, shipped pair)
    python3 benchmarks/ingress_cpu.py --device cuda --ingress-replicas 1,2 --out OUT          (GPU, constructed pair)

Deploys unified with N ingress replicas, drives `--streams` greedy streams of `--max-tokens` each through
Serve's proxy for `--seconds`, and reads every ingress replica's CPU time (psutil) before and after. On
a GPU host one ingress replica ran at a full core while unified served ~7,000 tok/s (docs/lanes_one_gpu.md):
its CPU per chunk times the chunks a second is the most one replica can stream. `--py-spy PATH` also
records each ingress replica's stacks (raw, one file each) for the table of busiest frames.

Writes ingress_cpu.json and ingress_cpu.md under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.apps import PRESETS, app_args, engine_args  # noqa: E402
from benchmarks.lib.cluster import (REPO, deploy, git_commit, log, machine, serve_env,  # noqa: E402
                                    start_cluster, start_model_cluster)
from benchmarks.lib.pairs import PAIR_DIR, save_pair  # noqa: E402
from benchmarks.profile_loads import serve_processes  # noqa: E402


def ingress_pids(app: str) -> list[int]:
    return [pid for role, pid in serve_processes(app) if role == "Ingress"]


def cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def drive(url: str, model: str, streams: int, max_tokens: int, seconds: float) -> dict[str, int]:
    """Closed loop: each of `streams` clients sends its next request when the last ends; counts the SSE chunks."""
    counts = {"requests": 0, "chunks": 0, "errors": 0}

    async def client(http: httpx.AsyncClient, i: int, deadline: float) -> None:
        while time.monotonic() < deadline:
            body = {"model": model, "prompt": f"def f{i}(x):", "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True, "temperature": 0.0}
            async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    counts["chunks"] += line.startswith("data: {")
            counts["requests" if r.status_code == 200 else "errors"] += 1

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=streams + 1)) as http:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(client(http, i, deadline) for i in range(streams)))
    return counts


def measure(args: argparse.Namespace, port: int, config: dict, replicas: int) -> dict:
    name = f"ingress{replicas}"
    config = {**config, "ingress": {**config["ingress"], "num_replicas": replicas}}
    deploy(name, config, timeout_s=PRESETS[args.device]["deploy_timeout_s"])
    try:
        url, model = f"http://127.0.0.1:{port}/{name}", config.get("model_name", "vpd-python")
        asyncio.run(drive(url, model, args.streams, args.max_tokens, 5.0))  # warm
        pids = ingress_pids(name)
        spies = [subprocess.Popen([args.py_spy, "record", "--pid", str(pid), "--nonblocking", "--rate", "100",
                                   "--duration", str(int(args.seconds)), "--format", "raw",
                                   "--output", str(args.out / f"{name}_{pid}.txt")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for pid in pids] if args.py_spy else []
        before, start_s = [cpu_s(pid) for pid in pids], time.monotonic()
        counts = asyncio.run(drive(url, model, args.streams, args.max_tokens, args.seconds))
        wall_s = time.monotonic() - start_s
        used_s = [cpu_s(pid) - b for pid, b in zip(pids, before)]
        for spy in spies:
            spy.wait()
    finally:
        serve.delete(name)
    tokens = counts["requests"] * args.max_tokens
    return {"ingress_replicas": replicas, **counts, "wall_s": round(wall_s, 2), "tok_s": round(tokens / wall_s, 1),
            "chunks_s": round(counts["chunks"] / wall_s, 1), "ingress_cpu_s": [round(s, 2) for s in used_s],
            "ingress_cores": [round(s / wall_s, 3) for s in used_s],
            "ingress_cpu_us_per_chunk": round(1e6 * sum(used_s) / max(counts["chunks"], 1), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ingress-replicas", default="1", help="comma-separated: one deployment each")
    parser.add_argument("--streams", type=int, default=None, help="default 32 (cpu), 64 (cuda)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 64 (cpu), 128 (cuda)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--py-spy", default=None, help="py-spy's path: record every ingress replica's stacks")
    parser.add_argument("--serve-throughput-optimized", action="store_true",
                        help="start Ray with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (Serve's high-throughput settings)")
    args = parser.parse_args()
    args.streams = args.streams or (64 if args.device == "cuda" else 32)
    args.max_tokens = args.max_tokens or (128 if args.device == "cuda" else 64)
    args.out.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[args.device]
    if args.device == "cuda":
        pair = save_pair("tinyllama-7b", 0.8, PAIR_DIR, dtype=preset["dtype"], device="cuda", reload_check="structure")
        target, draft, port = pair.target, pair.draft, start_model_cluster(serve_env(args.serve_throughput_optimized))
    else:
        target, draft = REPO / "models" / "vpd-target", REPO / "models" / "vpd-draft"
        port = start_cluster(serve_env(args.serve_throughput_optimized))
    engine = engine_args(8192 if args.device == "cuda" else 512, max(args.streams, 16))
    config = app_args("unified", target, draft, dtype=preset["dtype"], engine=engine,
                      lane_num_cpus=preset["lane_num_cpus"], one_gpu=args.device == "cuda")
    rows = []
    try:
        for replicas in [int(n) for n in args.ingress_replicas.split(",")]:
            rows.append(measure(args, port, config, replicas))
            log(f"ingress x{replicas}: {json.dumps(rows[-1])}")
    finally:
        serve.shutdown()
        ray.shutdown()
    context = {"command": "python benchmarks/ingress_cpu.py " + " ".join(sys.argv[1:]), "commit": git_commit(),
               "machine": machine(), "streams": args.streams,
               "serve_throughput_optimized": args.serve_throughput_optimized, "max_tokens": args.max_tokens}
    (args.out / "ingress_cpu.json").write_text(json.dumps({"context": context, "rows": rows}, indent=1))
    keys = ["ingress_replicas", "requests", "errors", "chunks", "wall_s", "tok_s", "chunks_s", "ingress_cores",
            "ingress_cpu_us_per_chunk"]
    lines = ["# OpenAI ingress CPU per streamed chunk", "", f"`{context['command']}`, commit {context['commit']}, "
             f"{context['machine'].get('gpu') or context['machine'].get('cpu_model')}; unified, {args.streams} streams "
             f"of {args.max_tokens} tokens, greedy", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row[k]) for k in keys) + " |" for row in rows]
    (args.out / "ingress_cpu.md").write_text("\n".join(lines) + "\n")
    log("done")


if __name__ == "__main__":
    main()
