"""Paged KV pools against contiguous per-request slots of the same memory, in process.

    python3 benchmarks/paged_capacity.py --out OUT [--budget-s 300]            (one GPU)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paged_capacity.py --device cpu --out /tmp/pc   (dry run)
    (or through benchmarks/gpu_evidence.py --part paged, with the same flags)

The baseline. The contiguous-slot pools no longer exist (paged pools came in 19a1c49; the slot code is its
parent, bb76a15). A slot pool gave every admitted request a slot of max_model_len plus slack
(EngineConfig.slot_capacity_tokens) in each model's pool, whatever the request's length, so in the same
memory it decodes at most floor(pool tokens / slot_capacity_tokens) requests at once: `contiguous_slots`.
The baseline here is THIS paged engine (same pools, kernels, CUDA graphs, the same process), admitting at
most that many requests at once. It reproduces the slot code's admission, not its step cost: on an H100 the
paged steps took 1.02-1.10x the slot code's (docs/performance.md, benchmarks/results/paged_kv_h100/), and
2 (d) measures that again, bb76a15's gpu_check.py against this code's in one call (docs/gpu_runs.md).
Dividing (b)'s ratio by that step ratio gives the ratio against the slot code itself.

(a) capacity. One co-located unified engine (the constructed 7B / TinyLlama pair on cuda, its `small`
    shape on cpu), max_model_len 32,768, pools sized by the engine's memory profile
    (gpu_memory_utilization; on cpu --cpu-kv-blocks), prefix caching off. --capacity-requests requests of
    the log-normal workload of (b) are added at once; the most requests decoding in one step (before the
    first finishes) against `contiguous_slots` at 32,768. Goal >= 8x.
(b) throughput. Log-normal prompt lengths (median 512, sigma 1, clipped to 64-4,096: lengths vary over
    10x), --output-len output tokens (512 on cuda), greedy, ignore_eos, L = 3, on an engine of its own
    whose pools hold --throughput-kv-tokens (16,384 on cuda: 8 GiB of the 7B target's KV, what a 24 GB
    card has left beside its weights). Paged: every request in flight at once (the engine admits by free
    blocks). Contiguous: at most `contiguous_slots` at max_model_len 4,096 + output, the shortest that
    serves this workload and so the most slots a contiguous pool could have had. Output tok/s paged /
    contiguous, each over requests of its own (no prefix shared). Goal >= 2x.
    Why its own pools: on (a)'s 200k-token pools, with 128 output tokens, both decoded ~30 rows a step
    (H200, 2026-11-27: 0.96x): 6 prompt tokens to each output token made both prefill-bound, and the KV
    pool, which paging saves, bounded neither.

Writes paged.json and paged.md under --out, after each measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.cluster import STARTED_S, free_device_memory, git_commit, log, machine  # noqa: E402
from benchmarks.lib.results import ratio, rows_table, script_parser, verdict, write_document  # noqa: E402

GOALS = {"capacity": 8.0, "throughput": 2.0}
CAPACITY_LEN = 32768
BLOCK_TOKENS = 16  # EngineConfig.block_size's default
DRAFT_LEN = 3


# ---- the arithmetic ------------------------------------------------------------------------------

def contiguous_slots(pool_tokens: int, slot_capacity_tokens: int) -> int:
    """Requests a contiguous pool of `pool_tokens` decodes at once: one slot of `slot_capacity_tokens`
    (max_model_len + slack) each, whatever their lengths."""
    return pool_tokens // slot_capacity_tokens


def slot_capacity(max_model_len: int, max_draft_len: int) -> int:
    """EngineConfig.slot_capacity_tokens at `max_model_len`: the slot code sized its slots the same way."""
    from lanes.engine.core import EngineConfig

    return EngineConfig(max_model_len=max_model_len, max_draft_len=max_draft_len,
                        num_speculative_tokens=min(DRAFT_LEN, max_draft_len)).slot_capacity_tokens


def lognormal_lengths(count: int, seed: int, median: float = 512, sigma: float = 1.0, low: int = 64,
                      high: int = 4096) -> list[int]:
    from loadtest.workload import LogNormal

    return LogNormal(median, sigma, low, high).sample(count, np.random.default_rng(seed)).tolist()


def prompts_of(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(16, vocab_size, n).tolist() for n in lengths]


# ---- measurements --------------------------------------------------------------------------------

@dataclass
class Pools:
    num_kv_blocks: int  # the target's pool (the draft's has as many blocks, smaller ones)
    block_size: int

    @property
    def tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


def vocab_of(core) -> int:
    return core.local_runners()["target"].vocab_size


def target_pools(core) -> Pools:
    pool = core.local_runners()["target"].pool
    return Pools(pool.shape.num_blocks, pool.shape.block_size)


def peak_running(core, prompts: list[list[int]], output_len: int, deadline_s: float, patience_steps: int = 30) -> dict:
    """Add every prompt at once and step until every request is admitted and prefilled, or admission has
    stalled (no prompt prefilling and the running count flat for `patience_steps` steps: no blocks left),
    or the first request finishes; the most requests decoding (running) in one step meanwhile. Every
    request is aborted after."""
    from lanes.sample.params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = [uuid.uuid4().hex for _ in prompts]
    for rid, prompt in zip(ids, prompts):
        core.add_request(rid, prompt, params)
    sched = core.scheduler
    peak, steps, flat, stopped_by, start = 0, 0, 0, "deadline", time.perf_counter()
    while time.monotonic() < deadline_s:
        outputs = core.step()
        steps += 1
        running = len(sched.running)
        flat = 0 if running > peak or sched.prefilling else flat + 1
        peak = max(peak, running)
        if any(o.finished for o in outputs):
            stopped_by = "first finish"
        elif not sched.waiting and not sched.prefilling:
            stopped_by = "every request admitted"
        elif flat >= patience_steps:
            stopped_by = f"admission stalled for {patience_steps} steps (blocks)"
        else:
            continue
        break
    waiting = len(sched.waiting)
    for rid in ids:
        core.abort(rid)
    while core.has_work:  # the aborts take effect in a step
        core.step()
    return {"peak_running": peak, "requests": len(prompts), "waiting_at_stop": waiting, "steps": steps,
            "seconds": round(time.perf_counter() - start, 1), "stopped_by": stopped_by,
            "preemptions": sched.num_preemptions}


def build_engine(args: argparse.Namespace, max_model_len: int, max_num_seqs: int, kv_tokens: int | None):
    """The unified engine on the constructed pair, prefix caching off; pools of `kv_tokens` (None: sized by
    the memory profile at gpu_memory_utilization; on cpu --cpu-kv-blocks)."""
    from benchmarks.lib.pairs import save_pair
    from benchmarks.lib.engine_runs import colocated_engine
    from deployments.config import AppConfig

    pair = save_pair(args.shape, 0.8, args.pair_dir, dtype=args.dtype, device=args.device)
    engine = {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "num_speculative_tokens": DRAFT_LEN,
              "max_draft_len": 8, "enable_prefix_caching": False, "gpu_memory_utilization": args.gpu_memory_utilization,
              # Admission at several prompts a step (the memory profile sizes activations for these budgets).
              "prefill_chunk_tokens": args.prefill_tokens, "idle_prefill_tokens": 2 * args.prefill_tokens}
    if kv_tokens is not None:
        engine["num_kv_blocks"] = -(-kv_tokens // BLOCK_TOKENS)
    elif args.device == "cpu":
        engine["num_kv_blocks"] = args.cpu_kv_blocks
    cfg = AppConfig.model_validate({"mode": "unified", "target": {"path": str(pair.target), "dtype": args.dtype},
                                    "draft": {"path": str(pair.draft), "dtype": args.dtype}, "engine": engine})
    return colocated_engine(cfg, args.device)


def throughput(core, prompts: list[list[int]], output_len: int, concurrency: int, vocab_size: int) -> dict:
    from benchmarks.lib.engine_runs import Work, run_engine
    from loadtest.summary import summarize

    records, steps = run_engine(core, Work(prompts, output_len, concurrency, vocab_size))
    s = summarize(records)
    return {"concurrency": concurrency, "requests": len(prompts), "completed": s.completed, "failed": s.failed,
            "output_tok_s": round(s.output_token_throughput_tps, 1), "wall_s": round(s.wall_s, 1),
            "tpot_p50_ms": s.latency_ms["tpot_ms"].p50, "ttft_p50_ms": s.latency_ms["ttft_ms"].p50,
            "rows_mean": steps["profile"].get("rows_mean"), "step_ms_mean": round(steps["step_ms_mean"], 2)}


# ---- report --------------------------------------------------------------------------------------

def checks(doc: dict) -> list[dict]:
    rows = []
    cap = doc.get("capacity")
    if cap:
        value = ratio(cap["peak_running"], cap["contiguous_slots"])
        rows.append({"goal": "(a) requests decoded at once, paged / contiguous", "paged": cap["peak_running"],
                     "contiguous": cap["contiguous_slots"], "ratio": value, "bound": f">= {GOALS['capacity']}",
                     "verdict": verdict(value, (">=", GOALS["capacity"]))})
    tp = doc.get("throughput", {})
    if "paged" in tp and "contiguous" in tp:
        value = ratio(tp["paged"]["output_tok_s"], tp["contiguous"]["output_tok_s"])
        rows.append({"goal": "(b) output tok/s, paged / contiguous", "paged": tp["paged"]["output_tok_s"],
                     "contiguous": tp["contiguous"]["output_tok_s"], "ratio": value,
                     "bound": f">= {GOALS['throughput']}", "verdict": verdict(value, (">=", GOALS["throughput"]))})
    return rows


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# Issue 31, part paged: 2 (a) and (b) ({m.get('gpu') or m['cpu_model']})", "",
             f"`{doc['command']}`, commit {doc['commit']}, {time.monotonic() - STARTED_S:.0f} s.", "",
             "Baseline: this paged engine admitting at most the requests that contiguous slots of max_model_len "
             "(+ slack) would hold in the same pool memory (benchmarks/paged_capacity.py's docstring). Its steps "
             "are the paged steps: divide (b) by 2 (d)'s step ratio for the slot code's own.", "",
             f"(a) pools: {json.dumps(doc.get('pools'))}; (b) pools: "
             f"{json.dumps((doc.get('throughput') or {}).get('pools'))}", "", "## Against the goals", "", rows_table(doc["checks"])]
    lines += ["## Details", "", "```", json.dumps({k: doc.get(k) for k in ("capacity", "throughput")}, indent=1),
              "```", ""]
    return "\n".join(lines)


def write(doc: dict, out: Path) -> None:
    doc["checks"] = checks(doc)
    write_document(out, "paged", doc, markdown(doc))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = script_parser(__doc__, budget_s=300.0)
    parser.add_argument("--capacity-requests", type=int, default=None, help="default 512 on cuda, 64 on cpu")
    parser.add_argument("--throughput-requests", type=int, default=None, help="default 96 on cuda, 24 on cpu")
    parser.add_argument("--output-len", type=int, default=None, help="(b): default 512 on cuda, 8 on cpu")
    parser.add_argument("--throughput-kv-tokens", type=int, default=None,
                        help="(b): tokens each pool holds; default 16,384 on cuda, 1,600 on cpu")
    parser.add_argument("--capacity-output-len", type=int, default=None,
                        help="(a): max_tokens, long enough that none finishes while the rest are admitted; "
                        "default 2048 on cuda, 64 on cpu")
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="engine.prefill_chunk_tokens (idle: 2x)")
    parser.add_argument("--max-prompt-len", type=int, default=None, help="default 4096 on cuda, 256 on cpu")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--capacity-len", type=int, default=None,
                        help=f"(a)'s max_model_len: default {CAPACITY_LEN} on cuda, 2048 on cpu")
    parser.add_argument("--cpu-kv-blocks", type=int, default=400,
                        help="cpu: blocks per pool (no memory profile on the CPU); 400 x 16 = 6,400 tokens")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    for key, gpu, cpu in (("capacity_requests", 512, 64), ("throughput_requests", 96, 24), ("output_len", 512, 8),
                          ("throughput_kv_tokens", 16384, 1600),
                          ("max_prompt_len", 4096, 256), ("capacity_len", CAPACITY_LEN, 2048), ("capacity_output_len", 2048, 64)):
        if getattr(args, key) is None:
            setattr(args, key, gpu if cuda else cpu)
    args.shape, args.dtype = ("tinyllama-7b", "bfloat16") if cuda else ("small", "float32")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    deadline_s = STARTED_S + args.budget_s - 10
    doc = {"command": "python3 benchmarks/paged_capacity.py " + " ".join(argv), "commit": git_commit(),
           "machine": machine(), "goals": GOALS}
    measure_capacity(args, doc, deadline_s)
    free_device_memory()  # (a)'s engine is gone with its function's frame; (b) needs the memory
    measure_throughput(args, doc, deadline_s)
    write(doc, args.out)
    log(f"done: {json.dumps(doc['checks'])}")


def workload_lengths(args: argparse.Namespace, count: int, seed: int) -> list[int]:
    return lognormal_lengths(count, seed=seed, high=args.max_prompt_len, low=min(64, args.max_prompt_len // 4),
                             median=min(512, args.max_prompt_len / 4))


def measure_capacity(args: argparse.Namespace, doc: dict, deadline_s: float) -> None:
    """(a): the most requests decoding at once at max_model_len 32,768, on pools sized by the profile."""
    with build_engine(args, args.capacity_len, args.capacity_requests, None) as core:
        pools = target_pools(core)
        doc["pools"] = {"num_kv_blocks": pools.num_kv_blocks, "block_size": pools.block_size, "tokens": pools.tokens}
        log(f"(a) pools: {doc['pools']}")
        lengths = workload_lengths(args, args.capacity_requests, seed=1)
        cap = peak_running(core, prompts_of(lengths, vocab_of(core), seed=2), args.capacity_output_len,
                           deadline_s - args.budget_s / 2)
        cap["contiguous_slots"] = contiguous_slots(pools.tokens, slot_capacity(args.capacity_len, core.config.max_draft_len))
        cap["max_model_len"] = args.capacity_len
        cap["slot_capacity_tokens"] = slot_capacity(args.capacity_len, core.config.max_draft_len)
        cap["prompt_tokens_mean"] = round(float(np.mean(lengths)), 1)
        if cap["peak_running"] == cap["requests"]:
            cap["note"] = "every request ran at once: a lower bound, raise --capacity-requests"
        doc["capacity"] = cap
        write(doc, args.out)
        log(f"(a) capacity: {json.dumps(cap)}")


def measure_throughput(args: argparse.Namespace, doc: dict, deadline_s: float) -> None:
    """(b): output tok/s, paged against contiguous, on pools of --throughput-kv-tokens."""
    max_model_len = args.max_prompt_len + args.output_len  # the shortest that serves (b)'s workload
    with build_engine(args, max_model_len, args.throughput_requests, args.throughput_kv_tokens) as core:
        pools = target_pools(core)
        lengths = workload_lengths(args, args.throughput_requests, seed=3)
        slots = contiguous_slots(pools.tokens, slot_capacity(max_model_len, core.config.max_draft_len))
        doc["throughput"] = {"pools": {"num_kv_blocks": pools.num_kv_blocks, "block_size": pools.block_size,
                                       "tokens": pools.tokens},
                             "contiguous_slots": slots, "max_model_len_contiguous": max_model_len,
                             "output_len": args.output_len, "prompt_tokens_mean": round(float(np.mean(lengths)), 1)}
        log(f"(b) pools: {doc['throughput']['pools']}, contiguous slots {slots}")
        for index, (name, concurrency) in enumerate((("paged", args.throughput_requests), ("contiguous", max(slots, 1)))):
            if time.monotonic() > deadline_s - 30:
                doc["throughput"][name] = None
                log(f"(b) {name}: skipped, out of time")
                continue
            # Prompts of each run's own (prefix caching is off too).
            doc["throughput"][name] = throughput(core, prompts_of(lengths, vocab_of(core), seed=4 + index),
                                                 args.output_len, concurrency, vocab_of(core))
            write(doc, args.out)
            log(f"(b) {name}: {json.dumps(doc['throughput'][name])}")


if __name__ == "__main__":
    main()
