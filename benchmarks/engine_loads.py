"""The engine's own speed over loads and prefill budgets: one in-process engine per mode, no Ray.

    python3 benchmarks/engine_loads.py --device cuda --modes nospec,spec,unified[,ngram] \
        --concurrencies 1,16,64,128 --prefill-chunk-tokens 128,512 --out OUT
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine_loads.py --device cpu --concurrencies 1,8 --out /tmp/el

Each mode's engine is built once (max_num_seqs = the largest concurrency), its CUDA graphs are
captured before the first request as a served engine's are, and it is warmed up; then every
(concurrency, prefill budget) point runs a closed loop on it: C requests in flight, 4 C requests
(16 at C = 1) of random token-id prompts, greedy, ignore_eos. `engine.prefill_chunk_tokens` (the
prefill a step may launch while requests decode) is read each step, so a point sets it on the same
engine. Every point draws prompts of its own, so none reads another's prefix cache.

This is the in-process reference of benchmarks/serving_overhead.py (whose served ways need Ray),
for the question "which mode is fastest at which load, and what does the prefill budget cost":
spec and unified decode several tokens per row and step, so at high load they need more prompts
prefilled per step than nospec does to keep their rows full.

Writes engine_loads_<device>.json and .md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.cluster import git_commit, load_average, log, machine  # noqa: E402
from benchmarks.lib.pairs import save_pair  # noqa: E402
from benchmarks.serving_overhead import Work, app_config, colocated_engine, reseeded, run_engine  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from loadtest.summary import summarize  # noqa: E402
from transformers import AutoConfig  # noqa: E402

COLUMNS = ("mode", "concurrency", "prefill_chunk_tokens", "submitted", "completed", "failed", "output_tok_s",
           "x_nospec", "tpot_p50_ms", "tpot_p95_ms", "ttft_p50_ms", "ttft_p95_ms", "rows_mean", "step_ms_mean",
           "acceptance_rate", "stall_steps")


def prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    return np.random.default_rng(seed).integers(1, vocab_size, (count, length)).tolist()


class Watchdog:
    """A point that runs past its bound is stuck, not slow: dump every thread's stack (py-spy, where
    installed) to `out` and end the run, keeping what was written."""

    def __init__(self, bound_s: float, out: Path):
        self.bound_s, self.out, self.deadline = bound_s, out, None
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self) -> None:
        self.deadline = time.monotonic() + self.bound_s

    def disarm(self) -> None:
        self.deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            if self.deadline is not None and time.monotonic() > self.deadline:
                log(f"a point ran past {self.bound_s:.0f} s: stacks in {self.out}")
                if shutil.which("py-spy"):
                    dump = subprocess.run(["py-spy", "dump", "--pid", str(os.getpid()), "--locals"],
                                          capture_output=True, text=True, timeout=120)
                    self.out.write_text(dump.stdout + dump.stderr)
                os._exit(3)


def mode_points(mode: str, cfg: AppConfig, works: dict[int, Work], chunks: list[int], device: str,
                warmup: Work, watchdog: Watchdog, on_point, capture: bool = True) -> None:
    """Every (prefill budget, concurrency) point of one mode, each handed to `on_point` as it ends."""
    with colocated_engine(cfg, device, capture) as core:
        run_engine(core, warmup)
        # Only unified prefills beside decoding steps that emit several tokens a row: nospec's prefill
        # keeps up at one prompt a step, and spec prefills before decoding (in idle_prefill_tokens).
        for index, chunk in enumerate(chunks if mode == "unified" else chunks[:1]):
            core.config = replace(core.config, prefill_chunk_tokens=chunk,
                                  idle_prefill_tokens=max(chunk, core.config.idle_prefill_tokens))
            for concurrency, work in works.items():
                spec_before = core.total_stats.to_dict()
                watchdog.arm()
                # Prompts of this point's own: an earlier budget's are in the prefix cache.
                fresh = work if index == 0 else replace(work, prompts=reseeded(work, 1000 + index))
                records, steps = run_engine(core, fresh)
                watchdog.disarm()
                point = {"mode": mode, "concurrency": concurrency, "prefill_chunk_tokens": chunk,
                         "summary": summarize(records), "steps": steps,
                         "acceptance": _acceptance(spec_before, core.total_stats.to_dict())}
                log(f"{mode} c{concurrency} chunk {chunk}: {json.dumps(row(point))}")
                on_point(point)


def _acceptance(before: dict, after: dict) -> float | None:
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    return (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / drafted if drafted else None


def row(point: dict, nospec_tok_s: float | None = None) -> dict:
    s, profile = point["summary"], point["steps"]["profile"]
    lat = s.latency_ms
    tok_s = s.output_token_throughput_tps
    values = {
        "mode": point["mode"], "concurrency": point["concurrency"],
        "prefill_chunk_tokens": point["prefill_chunk_tokens"],
        "submitted": s.submitted, "completed": s.completed, "failed": s.failed, "output_tok_s": round(tok_s, 1),
        "x_nospec": round(tok_s / nospec_tok_s, 3) if nospec_tok_s else None,
        "tpot_p50_ms": _r(lat["tpot_ms"].p50), "tpot_p95_ms": _r(lat["tpot_ms"].p95),
        "ttft_p50_ms": _r(lat["ttft_ms"].p50), "ttft_p95_ms": _r(lat["ttft_ms"].p95),
        "rows_mean": _r(profile["rows_mean"]), "step_ms_mean": _r(point["steps"]["step_ms_mean"]),
        "acceptance_rate": _r(point["acceptance"], 3), "stall_steps": profile["stall_steps"],
    }
    return {c: values[c] for c in COLUMNS}


def _r(value, digits: int = 2):
    return None if value is None else round(value, digits)


def table(points: list[dict]) -> list[dict]:
    """Rows with each point's throughput over nospec's at the same concurrency (where measured)."""
    nospec = {p["concurrency"]: p["summary"].output_token_throughput_tps for p in points if p["mode"] == "nospec"}
    return [row(p, nospec.get(p["concurrency"])) for p in points]


def markdown(doc: dict) -> str:
    lines = [f"# The engine in process over loads ({doc['machine'].get('gpu') or doc['machine']['cpu_model']})", "",
             f"`{doc['command']}` (commit {doc['commit']}); {doc['work']}", "",
             "`acceptance_rate`: accepted / drafted tokens (vLLM's). `x_nospec`: output tokens/s over nospec's at "
             "the same concurrency, in this run. `stall_steps`: steps of 200 ms or more (a capture or compile on "
             "first use; 0 where graphs were captured at start).", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join("" if r[c] is None else str(r[c]) for c in COLUMNS) + " |" for r in doc["rows"]]
    if doc.get("stalls"):
        lines += ["", "## Stalls (steps of 200 ms or more: what they ran, and the graphs they captured)", ""]
        lines += [f"- {s['mode']} c{s['concurrency']} chunk {s['prefill_chunk_tokens']}: {json.dumps(s['stalls'])}"
                  for s in doc["stalls"]]
    return "\n".join(lines) + "\n"


def mode_config(mode: str, target, draft, args: argparse.Namespace) -> dict:
    """The mode's app config; `ngram`: unified drafting by prompt lookup (`draft: {method: ngram}`), no draft model."""
    if mode != "ngram":
        return app_config(mode, target, draft, args)
    config = app_config("unified", target, draft, args)
    config["draft"] = {"method": "ngram"}
    return config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", default="tinyllama-7b", help="cuda: the constructed pair's shape")
    parser.add_argument("--agreement", type=float, default=0.8, help="cuda: the constructed pair's agreement")
    parser.add_argument("--pair-dir", type=Path, default=Path("/tmp/vpd_gpu_modes"))
    parser.add_argument("--modes", default="nospec,spec,unified", help="any of nospec, spec, unified, ngram")
    parser.add_argument("--concurrencies", default=None, help="default 1,16,64,128 on cuda, 1,8 on cpu")
    parser.add_argument("--prefill-chunk-tokens", default=None,
                        help="comma list of engine.prefill_chunk_tokens (default: the app config's)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 on cuda, 64 on cpu")
    parser.add_argument("--output-len", type=int, default=None, help="default 128 on cuda, 64 on cpu")
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument("--point-timeout-s", type=float, default=180.0,
                        help="a point running longer is stuck: dump its stacks (py-spy) and stop")
    parser.add_argument("--no-capture", action="store_true", help="diagnosis: graphs captured on first use only")
    parser.add_argument("--one-stream", action="store_true", help="diagnosis: every lane on one CUDA stream")
    parser.add_argument("--prefill-graph-tokens", type=int, default=None,
                        help="diagnosis: lanes.model.cuda_graphs.PREFILL_GRAPH_TOKENS (0: no prefill graphs)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.concurrencies = [int(c) for c in (args.concurrencies or ("1,16,64,128" if cuda else "1,8")).split(",")]
    args.prompt_len = args.prompt_len or (128 if cuda else 64)
    args.output_len = args.output_len or (128 if cuda else 64)
    args.dtype = "bfloat16" if cuda else "float32"
    args.max_num_seqs = max(max(args.concurrencies), 8)
    args.lane_num_cpus = 1.0
    args.stream_interval_ms = None
    args.concurrency = args.max_num_seqs  # what app_config sizes the engine for
    args.modes = args.modes.split(",")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one_stream:
        import lanes.engine.core
        from lanes.device.streams import LaneStreams

        lanes.engine.core.LaneStreams = lambda device, separate=True: LaneStreams(device, separate=False)
    if args.prefill_graph_tokens is not None:
        import lanes.model.cuda_graphs

        lanes.model.cuda_graphs.PREFILL_GRAPH_TOKENS = args.prefill_graph_tokens
    target = draft = None
    if args.device == "cuda":
        pair = save_pair(args.shape, args.agreement, args.pair_dir, dtype=args.dtype, device=args.device)
        target, draft = pair.target, pair.draft
    chunks = args.prefill_chunk_tokens
    args.prefill_chunk_tokens = None  # app_config's engine override: each point sets its own
    probe = AppConfig.model_validate(app_config("nospec", target, draft, args))
    chunks = [int(c) for c in chunks.split(",")] if chunks else [probe.engine.prefill_chunk_tokens]
    vocab = AutoConfig.from_pretrained(probe.target.path).get_text_config().vocab_size
    works = {c: Work(prompts(vocab, 16 if c == 1 else 4 * c, args.prompt_len, seed=10 + c), args.output_len, c, vocab)
             for c in args.concurrencies}
    warmup = Work(prompts(vocab, 2 * args.max_num_seqs, args.prompt_len, seed=1), min(32, args.output_len),
                  args.max_num_seqs, vocab)
    doc = {"command": "python benchmarks/engine_loads.py " + " ".join(argv), "commit": git_commit(),
           "machine": machine(), "load_average_before": load_average(),
           "work": f"closed loops of C in flight, 4 C requests (16 at C = 1), prompts of {args.prompt_len} random "
                   f"tokens, {args.output_len} output tokens, greedy, ignore_eos, L = {args.draft_len}, {args.dtype}"
                   + (f", constructed {args.shape} pair at agreement {args.agreement}" if target else ", shipped pair"),
           "rows": []}
    points, stem = [], args.out / f"engine_loads_{args.device}"

    def on_point(point: dict) -> None:  # written at once: a later point may not end
        points.append(point)
        doc["rows"] = table(points)
        doc["stalls"] = [{"mode": p["mode"], "concurrency": p["concurrency"],
                          "prefill_chunk_tokens": p["prefill_chunk_tokens"], "stalls": p["steps"]["stalls"]}
                         for p in points if p["steps"]["stalls"]]
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
        stem.with_suffix(".md").write_text(markdown(doc))

    watchdog = Watchdog(args.point_timeout_s, args.out / "stuck_stacks.txt")
    for mode in args.modes:
        log(f"{mode}: building")
        mode_points(mode, AppConfig.model_validate(mode_config(mode, target, draft, args)), works, chunks,
                    args.device, warmup, watchdog, on_point, capture=not args.no_capture)
    log("done")


if __name__ == "__main__":
    main()
