"""Kill -9 of each lane's process in pdv and pd on one GPU, mid-load.

    python3 benchmarks/lane_faults.py --out OUT --budget-s 500                  # one H100/H200, ~9 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lane_faults.py --shape small --device cpu \\
        --out /tmp/lane_faults --budget-s 600                                     (CPU dry run)

The constructed Llama-2-7B / TinyLlama pair at agreement 0.8 (benchmarks/lib/pairs.py save_pair;
docs/constructed_pair.md; on the CPU the `small` shape), each app deployed as configs/<mode>.yaml with
its lanes on one GPU (benchmarks/lib/apps.py GPU_SHARES: pdv as configs/pdv-1gpu.yaml, pd 0.35 + 0.65),
one replica a lane, Serve's default health check (10 s) and replica retries: a user's deployment.

Per app: deploy, warm up (a burst of max_num_seqs requests: CUDA graphs are captured per batch
bucket on first use), then per lane in --kills order, `loadtest.faults.kill_and_recover`:
  1. greedy output of --greedy-prompts requests, one at a time; device memory per lane and the GPU's;
  2. --streams streams (greedy, ignore_eos, --output-len tokens) and, once each is under way, SIGKILL
     of the lane's replica process (found in Ray's actor table); --late more streams 1 s later;
  3. every stream's end (completed, or failed: an SSE error event or an HTTP error), /health 200
     again, the replacement up with the killed process's GPU memory released (wait_replaced);
  4. the same greedy requests again, and device memory again.
The next kill waits for that replacement, so each kill meets an app whole again.

Goals per kill: every stream in flight at the kill ends; those that fail end within 10 s
of the kill (one that completes may take longer: it waited for a recompute, and its end is stated);
none times out; the app serves again without a redeploy (recovered_s: /health 200 after the kill);
no other lane's process changed (a survivor that crashed would have been replaced by Serve);
greedy output after equals before; GPU memory after within 5 % of before, for the app's processes
(NVML, by pid) and for the whole GPU (which also counts memory a dead process left mapped in a peer:
the one-GPU lanes share KV pools by CUDA IPC).

The run keeps to --budget-s: a kill that no longer fits is recorded as skipped. Writes OUT/lane_faults.json
(context, every kill: its summary, every stream's record, notes, the replicas' last log lines where a
goal failed) and OUT/lane_faults.md (a row per kill), rewritten after every kill.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # replicas inherit it: kernels compile for the GPU

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from ray import serve  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.apps import PRESETS, AppRun, app_args, deploy_app, engine_args, run_loads  # noqa: E402
from benchmarks.lib.cluster import (git_commit, log, machine, replica_log_tail, start_cluster,  # noqa: E402
                                    wait_for_device_memory)
from benchmarks.lib.loads import Load, exactly, warmup_requests  # noqa: E402
from benchmarks.lib.pairs import PAIR_DIR, save_pair  # noqa: E402
from benchmarks.lib.results import rows_table, write_document  # noqa: E402
from loadtest.arrivals import OpenLoop  # noqa: E402
from loadtest.faults import KillResult, kill_and_recover, lane_processes, wait_healthy  # noqa: E402
from loadtest.workload import LogNormal, load_tokenizer, synthetic  # noqa: E402

NAME = "lane_faults"
LANES = {"pdv": ["PrefillLane", "VerifyLane", "DecodeLane"], "pd": ["PrefillLane", "DecodeLane"]}
DEFAULT_KILLS = ",".join(f"{mode}:{lane}" for mode, lanes in LANES.items() for lane in lanes)
FAIL_WITHIN_S = 10.0
MEMORY_WITHIN = 0.05
# By device. kill_s: what one kill is allowed from the budget (greedy before and after, the streams,
# the replacement's start: weights loaded, pools sized, graphs captured); deploy_s: an app's deploy and
# warm-up. The GPU figures are estimates (deploys of 15-20 s an app on an H200, docs/gpu_runs.md), not
# measurements of this script.
SIZES = {
    "cuda": dict(streams=32, late=8, prompt_len=128, output_len=256, greedy_prompts=16, greedy_tokens=32,
                 max_model_len=1024, max_num_seqs=64, kill_s=90.0, deploy_s=60.0, recover_timeout_s=150.0),
    "cpu": dict(streams=8, late=2, prompt_len=16, output_len=128, greedy_prompts=4, greedy_tokens=8,
                max_model_len=512, max_num_seqs=16, kill_s=100.0, deploy_s=120.0, recover_timeout_s=150.0),
}


# ---- one kill --------------------------------------------------------------------------------------

def ratio(after: float | None, before: float | None) -> float | None:
    return round(after / before, 4) if after is not None and before else None


def kill_row(mode: str, result: KillResult, survivors_replaced: list[str] | None = None) -> dict:
    """A kill's line of the table: the harness's summary, the failed streams' last end, the memory
    ratios and the goals (None where a quantity was not measured, e.g. memory on the CPU).
    `survivors_replaced`: the other lanes whose processes changed over the kill (one that crashed
    after its peer's death and was replaced by Serve)."""
    s = result.summary()
    failed_ends = [r.end_s for r in result.in_flight if r.status == "failed"]
    row = {"mode": mode, "lane": s["deployment"], **{k: v for k, v in s.items() if k not in ("app", "deployment")},
           "in_flight_failed_last_end_s": round(max(failed_ends), 2) if failed_ends else None,
           "survivors_replaced": survivors_replaced,
           "app_mib_ratio": ratio(s["device_mib_after"], s["device_mib_before"]),
           "device_used_ratio": ratio(s["device_used_mib_after"], s["device_used_mib_before"]),
           "errors": sorted({r.error for r in result.in_flight + result.after if r.error})[:3]}
    row["goals"] = {
        "streams_end": s["in_flight_timed_out"] == 0 and (row["in_flight_failed_last_end_s"] or 0.0) <= FAIL_WITHIN_S,
        "served_again": result.recovered_s is not None and result.replaced_s is not None,
        "survivors_intact": None if survivors_replaced is None else not survivors_replaced,
        "greedy_equal": result.greedy_equal,
        "memory": _memory_goal(row["app_mib_ratio"], row["device_used_ratio"]),
    }
    return row


def _memory_goal(*ratios: float | None) -> bool | None:
    measured = [r for r in ratios if r is not None]
    return all(abs(r - 1) <= MEMORY_WITHIN for r in measured) if measured else None


def run_kill(mode: str, lane: str, url: str, model: str, requests, late, greedy_prompts, sizes: dict) -> dict:
    """One kill (module docstring): its row and the harness's whole record of it."""
    pids = lambda: {name: {p.pid for p in lane_processes(mode, name)} for name in LANES[mode]}  # noqa: E731
    before = pids()
    result = kill_and_recover(url, model, mode, lane, LANES[mode], requests, late, greedy_prompts,
                              sizes["greedy_tokens"], recover_timeout_s=sizes["recover_timeout_s"])
    after = pids()
    row = kill_row(mode, result, [name for name in LANES[mode] if name != lane and after[name] != before[name]])
    log(f"{mode} {lane}: in flight {row['in_flight_completed']} completed / {row['in_flight_failed']} failed / "
        f"{row['in_flight_timed_out']} timed out, last failed end {row['in_flight_failed_last_end_s']} s, "
        f"last end {row['in_flight_last_end_s']} s; late {row['after_completed']}/{row['after_failed']}/"
        f"{row['after_timed_out']}; recovered {row['recovered_s']} s, replaced {row['replaced_s']} s; other lanes "
        f"replaced {row['survivors_replaced']}; greedy equal "
        f"{row['greedy_equal']}; memory app {row['app_mib_ratio']} GPU {row['device_used_ratio']}; goals {row['goals']}")
    record = {"row": row, **result.to_dict()}
    if not all(v is not False for v in row["goals"].values()):
        record["replica_logs"] = replica_log_tail(mode)[-6000:]
    return record


# ---- one app ---------------------------------------------------------------------------------------

def run_mode(mode: str, lanes: list[str], args: argparse.Namespace, pair, tokenizer, port: int, deadline_s: float,
             document: dict) -> None:
    """Deploy `mode`, warm it up, kill each of `lanes` in turn (appending to document["kills"] and
    rewriting the results after each), delete it."""
    sizes = args.sizes
    engine = engine_args(sizes["max_model_len"], sizes["max_num_seqs"])
    config = app_args(mode, pair.target, pair.draft, dtype=args.dtype, engine=engine,
                      lane_num_cpus=PRESETS[args.device]["lane_num_cpus"], one_gpu=args.device == "cuda")
    document["apps"][mode] = {"config": config}
    run = AppRun(mode)
    if not deploy_app(run, config, PRESETS[args.device]["deploy_timeout_s"]):
        document["apps"][mode] |= {"status": "failed", "error": run.error, "replica_logs": run.replica_logs}
        for lane in lanes:
            document["kills"].append({"row": {"mode": mode, "lane": lane, "status": "skipped: the app did not deploy"}})
        return
    url = f"http://127.0.0.1:{port}/{mode}"
    try:
        document["apps"][mode]["deploy_s"] = round(run.deploy_s, 1)
        prompts = LogNormal(sizes["prompt_len"], 0.6, 8, 3 * sizes["prompt_len"])
        warm = Load("warmup", warmup_requests(tokenizer, sizes["max_num_seqs"], args.seed + 7, prompts),
                    OpenLoop(math.inf), measured=False)
        run_loads(run, port, [warm], deadline_s, request_timeout_s=120.0, seed=args.seed)
        document["apps"][mode]["warmup"] = {"requests": len(warm.requests),
                                            "completed": run.points[-1][1].summary.completed if run.points else 0}
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        streams = synthetic(tokenizer, sizes["streams"] + sizes["late"], args.seed, exactly(sizes["prompt_len"]),
                            exactly(sizes["output_len"]))
        greedy = [r.prompt for r in synthetic(tokenizer, sizes["greedy_prompts"], args.seed + 1,
                                              exactly(sizes["prompt_len"]), exactly(sizes["greedy_tokens"]))]
        for lane in lanes:
            left_s = deadline_s - time.monotonic()
            if left_s < sizes["kill_s"]:
                skip = f"skipped: {left_s:.0f} s of the budget left, a kill needs ~{sizes['kill_s']:.0f} s"
                document["kills"].append({"row": {"mode": mode, "lane": lane, "status": skip}})
                log(f"{mode} {lane}: {skip}")
                continue
            if wait_healthy(url, 60) is None:
                document["kills"].append({"row": {"mode": mode, "lane": lane,
                                                  "status": "skipped: /health not 200 before the kill"}})
                continue
            try:
                record = run_kill(mode, lane, url, model, streams[:sizes["streams"]], streams[sizes["streams"]:],
                                  greedy, sizes)
            except Exception as exc:  # noqa: BLE001 - recorded; the next kill still runs
                log(f"{mode} {lane}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                record = {"row": {"mode": mode, "lane": lane, "status": f"error: {type(exc).__name__}: {exc}"},
                          "replica_logs": replica_log_tail(mode)[-6000:]}
            document["kills"].append(record)
            write_results(args.out, document)
    finally:
        serve.delete(mode)


# ---- results ---------------------------------------------------------------------------------------

TABLE = ["mode", "lane", "pid", "in flight c/f/t", "late c/f/t", "last failed end s", "last end s", "recovered_s",
         "replaced_s", "others replaced", "greedy_equal", "app GPU MiB before -> after", "GPU used MiB before -> after", "goals met"]


def table_row(row: dict) -> dict:
    if "status" in row:
        return {"mode": row["mode"], "lane": row["lane"], "pid": row["status"]}
    counts = lambda p: "/".join(str(row[f"{p}_{s}"]) for s in ("completed", "failed", "timed_out"))  # noqa: E731
    memory = lambda k, r: (f"{row[f'{k}_before']} -> {row[f'{k}_after']} ({row[r]})"  # noqa: E731
                           if row[f"{k}_before"] is not None else "n/a")
    missed = [goal for goal, met in row["goals"].items() if met is False]
    unmeasured = [goal for goal, met in row["goals"].items() if met is None]
    return {"mode": row["mode"], "lane": row["lane"], "pid": row["pid"], "in flight c/f/t": counts("in_flight"),
            "late c/f/t": counts("after"), "last failed end s": row["in_flight_failed_last_end_s"],
            "last end s": row["in_flight_last_end_s"], "recovered_s": row["recovered_s"],
            "replaced_s": row["replaced_s"], "others replaced": ", ".join(row.get("survivors_replaced") or []) or "none",
            "greedy_equal": row["greedy_equal"],
            "app GPU MiB before -> after": memory("device_mib", "app_mib_ratio"),
            "GPU used MiB before -> after": memory("device_used_mib", "device_used_ratio"),
            "goals met": ("all" if not missed else "NOT " + ", ".join(missed))
            + (f" ({', '.join(unmeasured)} not measured)" if unmeasured else ""),
            "errors": row.get("errors")}


def markdown(document: dict) -> str:
    rows = [table_row(k["row"]) for k in document["kills"]]
    lines = [f"# Lane kills under load ({document['device']}, {document['pair']['shape']} pair)", "",
             f"`{document['command']}` at {document['commit']}; {document['machine'].get('gpu') or 'no GPU'}; "
             f"{document['sizes']['streams']} streams of {document['sizes']['output_len']} tokens in flight at each "
             f"kill, {document['sizes']['late']} more 1 s after it; greedy check on "
             f"{document['sizes']['greedy_prompts']} requests of {document['sizes']['greedy_tokens']} tokens.", "",
             "c/f/t: completed / failed / timed out. Times in seconds after the kill. Goals: every failed stream "
             f"ends within {FAIL_WITHIN_S:g} s and none times out; /health 200 and the replacement up; no other "
             "lane's process replaced; greedy "
             f"equal; GPU memory within {100 * MEMORY_WITHIN:g} %.", ""]
    if rows:
        table = [{c: r.get(c) for c in TABLE} | {"errors": r.get("errors")} for r in rows]
        lines.append(rows_table(table, labels=2))
    for mode, app in document["apps"].items():
        if app.get("status") == "failed":
            lines += [f"{mode}: deploy failed: {app.get('error')}", ""]
    lines.append(f"Run time {document['duration_s']} s of a {document['budget_s']:g} s budget.")
    return "\n".join(lines) + "\n"


def write_results(out: Path, document: dict) -> None:
    document["duration_s"] = round(time.monotonic() - document["started_monotonic_s"], 1)
    write_document(out, NAME, {k: v for k, v in document.items() if k != "started_monotonic_s"}, markdown(document))


# ---- main ------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results directory")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock allowance of the whole run")
    parser.add_argument("--kills", default=DEFAULT_KILLS, help="mode:Deployment, in order (apps deployed in the "
                        "order their first kill comes)")
    parser.add_argument("--shape", choices=("tinyllama-7b", "small"), default="tinyllama-7b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--agreement", type=float, default=0.8, help="the constructed pair's designed agreement")
    parser.add_argument("--pair-dir", type=Path, default=PAIR_DIR, help="where the pair is saved (a finished save "
                        "there is reused)")
    parser.add_argument("--seed", type=int, default=0)
    for key, value in SIZES["cuda"].items():
        parser.add_argument("--" + key.replace("_", "-"), type=type(value), default=None,
                            help=f"default {value} on cuda, {SIZES['cpu'][key]} on cpu")
    args = parser.parse_args(argv)
    args.sizes = {key: SIZES[args.device][key] if getattr(args, key) is None else getattr(args, key)
                  for key in SIZES["cuda"]}
    args.dtype = PRESETS[args.device]["dtype"]
    args.kill_list = [tuple(k.split(":")) for k in args.kills.split(",")]
    unknown = [k for k in args.kill_list if len(k) != 2 or k[0] not in LANES or k[1] not in LANES[k[0]]]
    if unknown:
        parser.error(f"unknown kills {unknown}; choose from {DEFAULT_KILLS}")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    deadline_s = time.monotonic() + args.budget_s
    log(f"{NAME}: kills {args.kills} on {args.device}, budget {args.budget_s:.0f} s")
    pair = save_pair(args.shape, args.agreement, args.pair_dir, dtype=args.dtype, device=args.device, seed=args.seed)
    tokenizer = load_tokenizer(pair.target)
    document = {"command": "python3 benchmarks/lane_faults.py " + " ".join(argv), "commit": git_commit(),
                "machine": machine(), "device": args.device, "budget_s": args.budget_s, "sizes": args.sizes,
                "pair": {"shape": args.shape, "agreement": args.agreement, "dtype": args.dtype,
                         "target": str(pair.target), "draft": str(pair.draft), "check": pair.check},
                "apps": {}, "kills": [], "started_monotonic_s": time.monotonic(), "duration_s": 0.0}
    # Serve's own replica retries (not start_model_cluster's one): a replacement that fails to start,
    # say while the killed process's memory is not yet back, is retried as in a user's deployment.
    port = start_cluster({"TOKENIZERS_PARALLELISM": "false",
                          "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0")})
    free_bytes = torch.cuda.mem_get_info()[0] if args.device == "cuda" else None
    log(f"Ray and Serve up (port {port})")
    try:
        for mode in dict.fromkeys(mode for mode, _ in args.kill_list):
            if deadline_s - time.monotonic() < args.sizes["deploy_s"] + args.sizes["kill_s"]:
                for lane in [lane for m, lane in args.kill_list if m == mode]:
                    document["kills"].append({"row": {"mode": mode, "lane": lane,
                                                      "status": "skipped: no time left to deploy the app"}})
                continue
            run_mode(mode, [lane for m, lane in args.kill_list if m == mode], args, pair, tokenizer, port,
                     deadline_s, document)
            if free_bytes is not None:  # the deleted app's memory is back before the next one sizes its pools
                wait_for_device_memory(free_bytes, timeout_s=60)
            write_results(args.out, document)
    finally:
        serve.shutdown()
        ray.shutdown()
    write_results(args.out, document)
    log(f"done: {args.out / (NAME + '.md')}")
    print((args.out / f"{NAME}.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
