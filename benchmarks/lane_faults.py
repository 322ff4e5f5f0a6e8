"""Kill -9 of each lane's process in pdv and pd on one GPU, mid-load; method and goals: docs/gpu_faults.md.

    python3 benchmarks/lane_faults.py --out OUT --budget-s 500                  # one H100/H200, ~9 min
    python3 benchmarks/lane_faults.py --kills pdv:PrefillLane,pdv:VerifyLane,pdv:DecodeLane --out OUT
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lane_faults.py --shape small --device cpu \\
        --out /tmp/lane_faults --budget-s 600                                     (CPU dry run)

Writes OUT/lane_faults.json (every kill's summary and streams) and OUT/lane_faults.md (a row per kill and its
goals, then the kills skipped where --budget-s left no room), rewritten after every kill.
"""

import argparse
import sys
import time
import traceback
from pathlib import Path

import httpx
import torch
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.apps import deploy_warm, pair_and_cluster, sized_args  # noqa: E402
from benchmarks.lib.cluster import (git_commit, log, machine, replica_log_tail, serving,  # noqa: E402
                                    wait_for_device_memory)
from benchmarks.lib.loads import exactly  # noqa: E402
from benchmarks.lib.results import rows_table, script_parser, write_document  # noqa: E402
from loadtest.faults import KillResult, kill_and_recover, lane_processes, wait_healthy  # noqa: E402
from loadtest.workload import synthetic  # noqa: E402

NAME = "lane_faults"
LANES = {"pdv": ["PrefillLane", "VerifyLane", "DecodeLane"], "pd": ["PrefillLane", "DecodeLane"]}
DEFAULT_KILLS = ",".join(f"{mode}:{lane}" for mode, lanes in LANES.items() for lane in lanes)
FAIL_WITHIN_S = 10.0
MEMORY_WITHIN = 0.05
# By device; every key is also a flag. kill_s: what one kill is allowed from the budget (greedy before and
# after, the streams, the replacement's start); deploy_s: an app's deploy and warm-up. Estimates, from
# deploys of 15-20 s an app on an H200 (docs/gpu_runs.md).
SIZES = {
    "cuda": dict(streams=32, late=8, prompt_len=128, output_len=256, greedy_prompts=16, greedy_tokens=32,
                 max_model_len=1024, max_num_seqs=64, kill_s=90.0, deploy_s=60.0, recover_timeout_s=150.0),
    "cpu": dict(streams=8, late=2, prompt_len=16, output_len=128, greedy_prompts=4, greedy_tokens=8,
                max_model_len=512, max_num_seqs=16, kill_s=100.0, deploy_s=120.0, recover_timeout_s=150.0),
}


def ratio(after: float | None, before: float | None) -> float | None:
    return round(after / before, 4) if after is not None and before else None


def kill_row(mode: str, result: KillResult, survivors_replaced: list[str] | None = None) -> dict:
    """A kill's line of the table: the harness's summary, the failed streams' last end, the memory ratios and the goals
    (None where a quantity was not measured, e.g. memory on the CPU). `survivors_replaced`: the other lanes whose
    processes changed over the kill (one that crashed after its peer's death and was replaced by Serve)."""
    s = result.summary()
    failed_ends = [r.end_s for r in result.in_flight if r.status == "failed"]
    row = {"mode": mode, "lane": s["deployment"], **{k: v for k, v in s.items() if k not in ("app", "deployment")},
           "in_flight_failed_last_end_s": round(max(failed_ends), 2) if failed_ends else None,
           "survivors_replaced": survivors_replaced,
           "app_mib_ratio": ratio(s["device_mib_after"], s["device_mib_before"]),
           "device_used_ratio": ratio(s["device_used_mib_after"], s["device_used_mib_before"]),
           "errors": sorted({r.error for r in result.in_flight + result.after if r.error})[:3]}
    memory = [r for r in (row["app_mib_ratio"], row["device_used_ratio"]) if r is not None]  # none on the CPU
    row["goals"] = {
        "streams_end": s["in_flight_timed_out"] == 0 and (row["in_flight_failed_last_end_s"] or 0.0) <= FAIL_WITHIN_S,
        "served_again": result.recovered_s is not None and result.replaced_s is not None,
        "survivors_intact": None if survivors_replaced is None else not survivors_replaced,
        "greedy_equal": result.greedy_equal,
        "memory": all(abs(r - 1) <= MEMORY_WITHIN for r in memory) if memory else None,
    }
    return row


def run_kill(mode: str, lane: str, url: str, model: str, streams, greedy_prompts, sizes: dict) -> dict:
    """One kill: its row and the harness's whole record of it."""
    def pids() -> dict[str, set[int]]:
        return {name: {p.pid for p in lane_processes(mode, name)} for name in LANES[mode]}

    before = pids()
    result = kill_and_recover(url, model, mode, lane, LANES[mode], streams[:sizes["streams"]],
                              streams[sizes["streams"]:], greedy_prompts, sizes["greedy_tokens"],
                              recover_timeout_s=sizes["recover_timeout_s"])
    after = pids()
    row = kill_row(mode, result, [name for name in LANES[mode] if name != lane and after[name] != before[name]])
    log(f"{mode} {lane}: {table_row(row)}")
    record = {"row": row, **result.to_dict()}
    if any(met is False for met in row["goals"].values()):
        record["replica_logs"] = replica_log_tail(mode)[-6000:]
    return record


def skipped(mode: str, lane: str, why: str) -> dict:
    log(f"{mode} {lane}: skipped: {why}")
    return {"row": {"mode": mode, "lane": lane, "status": f"skipped: {why}"}}


def run_mode(mode: str, lanes: list[str], args: argparse.Namespace, pair, tokenizer, port: int, deadline_s: float,
             document: dict) -> None:
    """Deploy `mode`, warm it up, kill each of `lanes` in turn (appending to document["kills"] and
    rewriting the results after each), delete it."""
    sizes = args.sizes
    run, config = deploy_warm(mode, args, pair, tokenizer, port, deadline_s, sizes["prompt_len"])
    document["apps"][mode] = {"config": config, "status": run.status, "error": run.error,
                              "replica_logs": run.replica_logs, "deploy_s": run.deploy_s,
                              "warmup_completed": run.points[-1][1].summary.completed if run.points else 0}
    if run.status == "failed":
        document["kills"] += [skipped(mode, lane, "the app did not deploy") for lane in lanes]
        return
    url = f"http://127.0.0.1:{port}/{mode}"
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        streams = synthetic(tokenizer, sizes["streams"] + sizes["late"], args.seed, exactly(sizes["prompt_len"]),
                            exactly(sizes["output_len"]))
        greedy = [r.prompt for r in synthetic(tokenizer, sizes["greedy_prompts"], args.seed + 1,
                                              exactly(sizes["prompt_len"]), exactly(sizes["greedy_tokens"]))]
        for lane in lanes:
            left_s = deadline_s - time.monotonic()
            if left_s < sizes["kill_s"]:
                why = f"{left_s:.0f} s of the budget left, a kill needs ~{sizes['kill_s']:.0f} s"
                record = skipped(mode, lane, why)
            elif wait_healthy(url, 60) is None:
                record = skipped(mode, lane, "/health not 200 before the kill")
            else:
                try:
                    record = run_kill(mode, lane, url, model, streams, greedy, sizes)
                except Exception as exc:  # noqa: BLE001 - recorded; the next kill still runs
                    log(f"{mode} {lane}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                    record = {"row": {"mode": mode, "lane": lane, "status": f"error: {type(exc).__name__}: {exc}"},
                              "replica_logs": replica_log_tail(mode)[-6000:]}
            document["kills"].append(record)
            write_results(args.out, document)
    finally:
        serve.delete(mode)


def table_row(row: dict) -> dict:
    """A measured kill's line of the Markdown table."""
    def counts(prefix: str) -> str:
        return "/".join(str(row[f"{prefix}_{s}"]) for s in ("completed", "failed", "timed_out"))

    def memory(key: str, ratio_key: str) -> str:
        if row[f"{key}_before"] is None:
            return "n/a"
        return f"{row[f'{key}_before']} -> {row[f'{key}_after']} ({row[ratio_key]})"

    missed = [goal for goal, met in row["goals"].items() if met is False]
    unmeasured = [goal for goal, met in row["goals"].items() if met is None]
    return {"mode": row["mode"], "lane": row["lane"], "pid": row["pid"], "in flight c/f/t": counts("in_flight"),
            "late c/f/t": counts("after"), "last failed end s": row["in_flight_failed_last_end_s"],
            "last end s": row["in_flight_last_end_s"], "recovered_s": row["recovered_s"],
            "replaced_s": row["replaced_s"],
            "others replaced": ", ".join(row.get("survivors_replaced") or []) or "none",
            "greedy_equal": row["greedy_equal"],
            "app GPU MiB before -> after": memory("device_mib", "app_mib_ratio"),
            "GPU used MiB before -> after": memory("device_used_mib", "device_used_ratio"),
            "goals met": ("all" if not missed else "NOT " + ", ".join(missed))
            + (f" ({', '.join(unmeasured)} not measured)" if unmeasured else ""),
            "errors": row.get("errors")}


def markdown(document: dict) -> str:
    rows, sizes = [k["row"] for k in document["kills"]], document["sizes"]
    lines = [f"# Lane kills under load ({document['device']}, {document['pair']['shape']} pair)", "",
             f"`{document['command']}` at {document['commit']}; {document['machine'].get('gpu') or 'no GPU'}; "
             f"{sizes['streams']} streams of {sizes['output_len']} tokens in flight at each kill, {sizes['late']} "
             f"more 1 s after it; greedy check on {sizes['greedy_prompts']} requests of {sizes['greedy_tokens']} "
             "tokens.", "",
             "c/f/t: completed / failed / timed out. Times in seconds after the kill. Goals: every failed stream "
             f"ends within {FAIL_WITHIN_S:g} s and none times out; /health 200 and the replacement up; no other "
             f"lane's process replaced; greedy equal; GPU memory within {100 * MEMORY_WITHIN:g} %.", ""]
    lines.append(rows_table([table_row(r) for r in rows if "status" not in r], labels=2))
    lines += [f"- {r['mode']} {r['lane']}: {r['status']}" for r in rows if "status" in r] + [""]
    lines += [f"{mode}: deploy failed: {app['error']}\n" for mode, app in document["apps"].items()
              if app.get("status") == "failed"]
    lines.append(f"Run time {document['duration_s']} s of a {document['budget_s']:g} s budget.")
    return "\n".join(lines) + "\n"


def write_results(out: Path, document: dict) -> None:
    document["duration_s"] = round(time.monotonic() - document["started_monotonic_s"], 1)
    write_document(out, NAME, {k: v for k, v in document.items() if k != "started_monotonic_s"}, markdown(document))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = script_parser(__doc__, budget_s=540.0, pair=True)
    parser.add_argument("--kills", default=DEFAULT_KILLS, help="mode:Deployment, in order (apps deployed in the "
                        "order their first kill comes)")
    args = sized_args(parser, SIZES, argv)
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
    pair, tokenizer, port = pair_and_cluster(args)
    document = {"command": "python3 benchmarks/lane_faults.py " + " ".join(argv), "commit": git_commit(),
                "machine": machine(), "device": args.device, "budget_s": args.budget_s, "sizes": args.sizes,
                "pair": {"shape": args.shape, "agreement": args.agreement, "dtype": args.dtype,
                         "target": str(pair.target), "draft": str(pair.draft), "check": pair.check},
                "apps": {}, "kills": [], "started_monotonic_s": time.monotonic(), "duration_s": 0.0}
    free_bytes = torch.cuda.mem_get_info()[0] if args.device == "cuda" else None
    with serving(port):
        for mode in dict.fromkeys(mode for mode, _ in args.kill_list):
            lanes = [lane for m, lane in args.kill_list if m == mode]
            if deadline_s - time.monotonic() < args.sizes["deploy_s"] + args.sizes["kill_s"]:
                document["kills"] += [skipped(mode, lane, "no time left to deploy the app") for lane in lanes]
                continue
            run_mode(mode, lanes, args, pair, tokenizer, port, deadline_s, document)
            wait_for_device_memory(free_bytes, timeout_s=60)  # the deleted app's, before the next sizes its pools
            write_results(args.out, document)
    write_results(args.out, document)
    print((args.out / f"{NAME}.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
