"""The GPU evidence of docs/performance.md, one part per device call or several per call; every ratio from one run.

    python3 benchmarks/gpu_evidence.py --part controller|extras|prefix|ngram|paged|families \\
        --out OUT [--budget-s 540]                                        (one GPU: H100 or H200)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gpu_evidence.py --part PART --device cpu --out /tmp/ev
                                                                          (CPU dry run: the path, not the numbers)

The served parts drive apps through Serve's proxy and the OpenAI ingress with the load tester (loadtest/: every
submitted request is completed, failed or timed out, and counted). On cuda they serve the constructed
Llama-2-7B / TinyLlama pair at agreement 0.8 (benchmarks/constructed_pair.py, saved by benchmarks/lib/pairs.py save_pair;
docs/constructed_pair.md), on cpu the same construction at the `small` shape. Its word-level tokenizer makes
a prompt of n words n tokens, and the target's greedy next token after x is the successor σ(x) whatever the
context, so workloads are built from token ids: random ids, a shared prefix, or a document the output copies.
Greedy, ignore_eos (but under a grammar), L = 3.

    controller  served nospec, then spec and unified with the draft-length controller on; closed loops of
                1, 16, 64, 128 and 256 in flight, then Poisson at --rate-factor x nospec's completed
                requests/s at 128 in flight (the same arrival times for every mode). Each point's output
                tok/s over nospec's (goal >= 0.97 everywhere, >= 1.3 at 1 and 16), and the controller's state
                sampled every 0.5 s (/v1/controller): L over time against requests in flight (png), and the
                signals each point saw (verify queue depth, requests per verify batch, decode p95, arrival rate).
    extras      one unified app, 64 in flight: plain, `logprobs: 5`, presence/frequency/repetition
                penalties, a `json_schema` response format, then plain again (drift); each over the mean of
                the two plain points (goals >= 0.9, >= 0.9, >= 0.8). A grammar needs JSON's characters and an
                end token, so this part's pair is the same weights under a tokenizer with a few reserved ids
                (`grammar_pair`); the object's one string field takes the model's own tokens, so acceptance
                holds inside it.
    prefix      requests sharing one system prompt of --prefix-tokens (2,000) tokens plus a unique suffix,
                prefix cache on against off, in unified and in pdv (pdv prefills in its prefill lane, whose
                pools must find the prefix): TTFT p50 off / on (goal >= 3).
    ngram       unified with `draft: {method: ngram}` against nospec: a copy workload (the prompt holds a
                document, an instruction, and the document's first token, so the target's output repeats
                the document) at 1 and 16 in flight (tok/s ratio and acceptance), and random prompts at
                1 and 16 in flight (the drafter finds nothing to copy; goal >= 0.97).
    paged       benchmarks/paged_capacity.py: 2 (a) and (b), in process (its docstring says the baseline).
    families    benchmarks/families_fused.py: 3, step times and greedy equality (its docstring).

Each part keeps to --budget-s (a load that no longer fits is skipped and recorded as skipped) and rewrites
<part>.json and <part>.md under --out after every point, so a run cut short leaves what it measured; the
controller part adds controller_L.png where matplotlib is installed (the GPU image may lack it: the JSON
has the trace).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.constructed_pair import shape_configs, successor_maps  # noqa: E402
from benchmarks.lib.apps import AppRun, app_args, engine_args, run_app  # noqa: E402
from benchmarks.lib.cluster import (STARTED_S, git_commit, load_average, log, machine,  # noqa: E402
                                    start_model_cluster)
from benchmarks.lib.loads import Load  # noqa: E402
from benchmarks.lib.pairs import save_pair  # noqa: E402
from benchmarks.lib.results import (pyplot, ratio, row, rows_table, script_parser, verdict,  # noqa: E402
                                    write_document)
from loadtest.arrivals import ClosedLoop, OpenLoop  # noqa: E402
from loadtest.client import RequestOptions  # noqa: E402
from loadtest.workload import WorkloadRequest  # noqa: E402

AGREEMENT = 0.8
DRAFT_LEN = 3
SEED = 0
# Ids below RESERVED_IDS never appear in prompts; `grammar_pair` names them (end token, JSON's characters).
GRAMMAR_TOKENS = ["</s>", "{", "}", '"', ":", ",", "text", " "]  # compact JSON writes ": " and ", "
RESERVED_IDS = 16
JSON_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
               "additionalProperties": False}
GOALS = {  # the goals, by part and check: (comparison, value)
    "controller": {"every point": (">=", 0.97), "1 and 16 in flight": (">=", 1.3)},
    "extras": {"logprobs": (">=", 0.9), "penalties": (">=", 0.9), "json_schema": (">=", 0.8)},
    "prefix": {"ttft_p50 off / on": (">=", 3.0)},
    "ngram": {"plain": (">=", 0.97)},
}
# Sizes by device; cpu: the small pair on a 2-core machine, enough to walk every path.
PRESETS = {
    "cuda": dict(shape="tinyllama-7b", dtype="bfloat16", prompt_len=128, output_len=128, concurrencies="1,16,64,128,256",
                 requests_per_slot=2, min_measured_requests=64, settle_requests_per_slot=4, single_requests=4,
                 lane_num_cpus=1.0, extras_concurrency=64, extras_requests=128,
                 prefix_tokens=2000, suffix_tokens=32, prefix_output_len=16, prefix_concurrency=4,
                 prefix_requests=32, ngram_doc_tokens=1500, ngram_output_len=256, ngram_concurrencies="1,16",
                 request_timeout_s=180.0, deploy_timeout_s=300.0),
    "cpu": dict(shape="small", dtype="float32", prompt_len=32, output_len=16, concurrencies="1,4,8",
                requests_per_slot=1, min_measured_requests=0, settle_requests_per_slot=1, single_requests=2,
                lane_num_cpus=0.25, extras_concurrency=4, extras_requests=4,
                prefix_tokens=200, suffix_tokens=8, prefix_output_len=4, prefix_concurrency=2, prefix_requests=4,
                ngram_doc_tokens=120, ngram_output_len=24, ngram_concurrencies="1,4", request_timeout_s=300.0,
                deploy_timeout_s=600.0),
}


# ---- workloads from token ids -------------------------------------------------------------------

def words(ids: list[int]) -> str:
    """The word-level tokenizer's text of `ids`: token i is the word "t<i>"."""
    return " ".join(f"t{i}" for i in ids)


def id_request(ids: list[int], output_len: int, kind: str = "normal") -> WorkloadRequest:
    return WorkloadRequest(words(ids), len(ids), output_len, kind)


def random_ids(rng: np.random.Generator, vocab_size: int, n: int) -> list[int]:
    return rng.integers(RESERVED_IDS, vocab_size, n).tolist()


def random_requests(vocab_size: int, count: int, prompt_len: int, output_len: int, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng(seed)
    return [id_request(random_ids(rng, vocab_size, prompt_len), output_len) for _ in range(count)]


def shared_prefix_requests(vocab_size: int, count: int, prefix_len: int, suffix_len: int, output_len: int,
                           seed: int) -> list[WorkloadRequest]:
    """One system prompt of `prefix_len` tokens, each request's own `suffix_len` tokens after it."""
    rng = np.random.default_rng(seed)
    prefix = random_ids(rng, vocab_size, prefix_len)
    return [id_request(prefix + random_ids(rng, vocab_size, suffix_len), output_len, "shared_prefix")
            for _ in range(count)]


def chain(successor: np.ndarray, start: int, n: int) -> list[int]:
    """start, σ(start), σ(σ(start)), ...: `n` tokens of what the target generates greedily after `start`'s
    predecessor. [n]"""
    out = [start]
    while len(out) < n:
        out.append(int(successor[out[-1]]))
    return out


def copy_requests(successor: np.ndarray, count: int, doc_len: int, output_len: int, seed: int) -> list[WorkloadRequest]:
    """A document the output copies: the prompt is a run of the target's own chain (the document), eight
    random tokens (the instruction), and the document's first token again, after which the target's greedy
    output is the document's second token, third, ... The n-gram drafter finds each output n-gram in the
    prompt; a draft model gains nothing from it. Each request its own document."""
    assert output_len < doc_len, "the output copies the document: it must be longer than the output"
    rng = np.random.default_rng(seed)
    vocab_size = len(successor)
    requests = []
    for _ in range(count):
        doc = chain(successor, int(rng.integers(RESERVED_IDS, vocab_size)), doc_len)
        requests.append(id_request(doc + random_ids(rng, vocab_size, 8) + doc[:1], output_len, "copy"))
    return requests


# ---- the pair ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pair:
    target: Path
    draft: Path
    vocab_size: int
    successor: np.ndarray  # the target's greedy map σ, [V]


def saved_pair(args: argparse.Namespace) -> Pair:
    """The constructed pair of the device's shape (built and saved once under --pair-dir, reused after)."""
    saved = save_pair(args.shape, AGREEMENT, args.pair_dir, dtype=args.dtype, device=args.device, seed=SEED)
    vocab_size = shape_configs(args.shape)[0]["vocab_size"]
    successor, _ = successor_maps(vocab_size, AGREEMENT, SEED)
    return Pair(saved.target, saved.draft, vocab_size, successor.numpy())


def grammar_tokenizer(vocab_size: int):
    """The word-level tokenizer with ids 0..len(GRAMMAR_TOKENS)-1 renamed: an end token and JSON's characters
    (xgrammar reads a word-level vocabulary as raw strings). Ids up to RESERVED_IDS stay out of prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    for i, token in enumerate(GRAMMAR_TOKENS):
        del vocab[f"t{i}"]
        vocab[token] = i
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=f"t{RESERVED_IDS}"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", clean_up_tokenization_spaces=False)


def grammar_pair(pair: Pair) -> Pair:
    """The same weights (linked, not copied) under `grammar_tokenizer`, with id 0 as the end token: the
    target still follows σ, which meets id 0 once in 32,000 tokens."""
    tokenizer = grammar_tokenizer(pair.vocab_size)
    dirs = []
    for model_dir in (pair.target, pair.draft):
        out = model_dir.with_name(model_dir.name + "-grammar")
        out.mkdir(exist_ok=True)
        for weights in model_dir.glob("*.safetensors*"):
            link = out / weights.name
            if not link.exists():
                link.symlink_to(weights.resolve())
        config = json.loads((model_dir / "config.json").read_text())
        config["eos_token_id"] = 0
        (out / "config.json").write_text(json.dumps(config, indent=1))
        tokenizer.save_pretrained(out)
        dirs.append(out)
    return Pair(dirs[0], dirs[1], pair.vocab_size, pair.successor)


# ---- apps and results ----------------------------------------------------------------------------

def app_config(mode: str, pair: Pair, args: argparse.Namespace, *, engine: dict | None = None,
               ngram: bool = False) -> dict:
    """configs/<mode>.yaml's args on `pair` (benchmarks/lib/apps.py app_args): the part's engine sizes, L =
    DRAFT_LEN, one GPU's lane shares (cuda); in the controller part, the controller on in the drafting
    modes, --controller merged into its block."""
    config = app_args(mode, pair.target, pair.draft, dtype=args.dtype, lane_num_cpus=args.lane_num_cpus,
                      engine={**engine_args(args.max_model_len, args.max_num_seqs, DRAFT_LEN), **(engine or {})},
                      one_gpu=args.device == "cuda", controller=args.part == "controller")
    if args.part == "controller" and mode != "nospec":
        config["controller"].update(json.loads(args.controller))
    if ngram:
        config["draft"] = {"method": "ngram"}
    return config


def every_request_accounted(rows: list[dict]) -> bool:
    return all(r["submitted"] == r["completed"] + r["failed"] + r["timed_out"] for r in rows)


class Report:
    """One part's document: its apps, a row per point (benchmarks/lib/results.py's, every submitted request
    counted), the checks against the goals; <part>.json and <part>.md rewritten under --out after every point."""

    def __init__(self, part: str, args: argparse.Namespace, argv: list[str]):
        self.part, self.args = part, args
        self.doc = {"part": part, "command": "python3 benchmarks/gpu_evidence.py " + " ".join(argv),
                    "commit": git_commit(), "machine": machine(), "load_average_before": load_average(),
                    "goals": {k: list(v) for k, v in GOALS.get(part, {}).items()}, "apps": {}, "rows": [],
                    "checks": [], "notes": []}
        self.runs: dict[str, AppRun] = {}  # by app, from its first point on

    def serve(self, name: str, config: dict, port: int, loads: list[Load], deadline_s: float,
              sampler: Callable[[str, Load], Awaitable[None]] | None = None) -> AppRun:
        """Deploy `config` as app `name`, run `loads` in order (a row each as it ends), delete it."""
        a = self.args
        run = run_app(name, config, port, loads, deadline_s, deploy_timeout_s=a.deploy_timeout_s,
                      request_timeout_s=a.request_timeout_s, seed=SEED, on_point=self.add, sampler=sampler,
                      min_load_s=a.min_load_s)
        self.doc["apps"][name] = {"status": run.status, "error": run.error, "skipped": run.skipped,
                                  "deploy_s": round(run.deploy_s, 1) if run.deploy_s else None}
        return run

    def add(self, run: AppRun) -> None:
        load, point = run.points[-1]
        self.runs[run.name] = run
        s = point.summary
        self.doc["rows"].append({**row(point, app=run.name, load=load.name), "measured": load.measured,
                                 "in_flight mean": round(s.mean_in_flight, 1), "in_flight max": s.max_in_flight,
                                 "accept_len": round(s.spec_decode.mean_acceptance_length, 3)
                                 if s.spec_decode and s.spec_decode.mean_acceptance_length else None})
        self.write()

    def write(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - STARTED_S, 1)
        self.doc["every_request_accounted"] = every_request_accounted(self.doc["rows"])
        write_document(self.args.out, self.part, self.doc, self.markdown())

    def markdown(self) -> str:
        d, m = self.doc, self.doc["machine"]
        lines = [f"# Issue 31, part {d['part']} ({m.get('gpu') or m['cpu_model']})", "",
                 f"`{d['command']}`, commit {d['commit']}, {d['elapsed_s']:.0f} s; every submitted request "
                 f"accounted for: {d['every_request_accounted']}.", ""]
        lines += [f"- {n}" for n in d["notes"]] + [""]
        if d["checks"]:
            lines += ["## Against the goals", "", rows_table(d["checks"])]
        lines += ["## Apps", ""] + [f"- {name}: {json.dumps(status)}" for name, status in d["apps"].items()]
        lines += ["", "## Points", "", rows_table(d["rows"])]
        for key in d:
            if key.startswith("table:"):
                lines += [f"## {key[len('table:'):]}", "", rows_table(d[key])]
        return "\n".join(lines)


def row_of(report: Report, app: str, load: str) -> dict:
    """`app`'s row at `load` ({} where it was not measured)."""
    return next((r for r in report.doc["rows"] if r["app"] == app and r["load"] == load), {})


def tok_s(report: Report, app: str, load: str) -> float | None:
    return row_of(report, app, load).get("tok_s")


# ---- part 1: the controller ----------------------------------------------------------------------

TRACED = ("verify_queue_depth", "requests_per_verify_batch", "decode_step_p95_ms", "arrival_rate_rps")


def controller_sampler(trace: list[dict], app: str):
    """An async sampler of the app's /v1/controller every 0.5 s into `trace` (times since the part started)."""
    import httpx

    async def sample(url: str, _load: Load) -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                try:
                    state = (await http.get(url + "/v1/controller")).json()
                except (httpx.HTTPError, ValueError) as exc:
                    state = {"error": repr(exc)}
                signals = state.get("signals") or {}
                trace.append({"app": app, "t_s": round(time.monotonic() - STARTED_S, 2),
                              "default_draft_len": state.get("default_draft_len"),
                              "draft_len_cap": state.get("draft_len_cap"), "load": state.get("load"),
                              "fleet_accept_rate": state.get("fleet_accept_rate"),
                              # Why the controller chose that L: the step-cost fit, the drafter's cost
                              # and the decision's own account (a miss is diagnosed from these).
                              "step_cost": state.get("step_cost"), "draft_cost_ratio": state.get("draft_cost_ratio"),
                              "reason": state.get("reason"),
                              **{k: signals.get(k) for k in TRACED}})
                await asyncio.sleep(0.5)
    return sample


def settle_requests(args: argparse.Namespace, concurrency: int) -> int:
    """Requests of the unmeasured closed loop before the point at `concurrency`."""
    return max(3 * args.single_requests, args.settle_requests_per_slot * concurrency)


def controller_loads(requests: list[WorkloadRequest], concurrencies: list[int], args: argparse.Namespace,
                     poisson: dict) -> list[Load]:
    """Warm-up (max_num_seqs at once), the closed loops, then Poisson (`poisson`: the Load's arrivals, or
    its rate_of and factor). Each closed loop is measured after an unmeasured one of the same
    concurrency (`settle_requests_per_slot` x C requests, at least 3 x `single_requests`), so that the
    point shows the L the controller settles on at that load, not its way there from the last load
    (on an H200, unified measured at 1 in flight right after the warm-up's burst ran at L = 0 throughout)."""
    loads = [Load("warmup", requests[: args.max_num_seqs], OpenLoop(float("inf")), measured=False)]
    for c in concurrencies:
        if args.settle_requests_per_slot:
            loads.append(Load(f"settle c{c}", requests[-settle_requests(args, c):], ClosedLoop(c), measured=False))
        # At least `min_measured_requests` a point: 2 x 16 requests are ~2 s on an H200, and in one run the
        # same app gave 1.42x nospec over its 64 settling requests and 1.25x over the 32 measured after.
        count = args.single_requests if c == 1 else max(args.requests_per_slot * c, args.min_measured_requests)
        loads.append(Load(f"c{c}", requests[:count], ClosedLoop(c)))
    return loads + [Load("poisson", requests[: args.requests_per_slot * max(concurrencies)], **poisson)]


def controller_checks(report: Report, modes: list[str], loads: list[str]) -> list[dict]:
    """Each drafting mode's tok/s over nospec's at every load, against the goal that applies there."""
    checks = []
    for mode in modes:
        for load in loads:
            value = ratio(tok_s(report, mode, load), tok_s(report, "nospec", load))
            goal = GOALS["controller"]["1 and 16 in flight" if load in ("c1", "c16") else "every point"]
            checks.append({"mode": mode, "load": load, "x_nospec": value, "goal": f"{goal[0]} {goal[1]}",
                           "verdict": verdict(value, goal)})
    return checks


def windows(run: AppRun) -> list[tuple[str, float, float]]:
    """Each point's load, first submit and last end (seconds on the log's clock, as the trace's)."""
    return [(load.name, steps[0][0], steps[-1][0]) for load, _ in run.points if (steps := run.in_flight.get(load.name))]


def trace_by_point(report: Report, trace: list[dict]) -> list[dict]:
    """What the controller saw and set during each point: mean L and the mean of each signal."""
    rows = []
    for app, run in report.runs.items():
        for load, start_s, end_s in windows(run):
            samples = [s for s in trace if s["app"] == app and start_s <= s["t_s"] <= end_s]
            if not samples:
                continue
            means = {"app": app, "load": load, "samples": len(samples)}
            for key in ("default_draft_len", "draft_len_cap", *TRACED):
                values = [s[key] for s in samples if isinstance(s.get(key), (int, float))]
                means[f"{key} mean"] = round(float(np.mean(values)), 2) if values else None
            rows.append(means)
    return rows


def plot_controller(report: Report, trace: list[dict], path: Path) -> None:
    """L (the controller's default draft length) and requests in flight over time, one panel per mode."""
    plt = pyplot()
    if plt is None:
        report.doc["notes"].append("no matplotlib here: controller_L.png not drawn (the JSON has the trace)")
        return
    apps = sorted({s["app"] for s in trace})
    if not apps:
        return
    fig, axes = plt.subplots(len(apps), 1, figsize=(10, 3.2 * len(apps)), squeeze=False)
    for ax, app in zip(axes[:, 0], apps):
        samples = [s for s in trace if s["app"] == app and s["default_draft_len"] is not None]
        ax.step([s["t_s"] for s in samples], [s["default_draft_len"] for s in samples], where="post", color="C0",
                label="L (default draft length)")
        ax.set_ylabel("L")
        ax.set_title(app)
        flight = ax.twinx()
        run = report.runs.get(app)
        for load, start_s, end_s in windows(run) if run else []:
            flight.step(*zip(*run.in_flight[load]), where="post", color="C1", alpha=0.6)
            ax.axvspan(start_s, end_s, alpha=0.06, color="grey")
            ax.text(start_s, ax.get_ylim()[1], load, fontsize=7, va="top")
        flight.set_ylabel("requests in flight", color="C1")
        ax.set_xlabel("seconds since the part started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def part_controller(args: argparse.Namespace, report: Report, port: int, deadline_s: float) -> None:
    pair = saved_pair(args)
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    # The settling loads take theirs from the end, apart from the measured ones (whose prompts they would
    # otherwise leave in the prefix cache).
    settle = settle_requests(args, max(concurrencies))
    requests = random_requests(pair.vocab_size, args.requests_per_slot * max(concurrencies) + args.max_num_seqs + settle,
                               args.prompt_len, args.output_len, SEED)
    modes = args.modes.split(",")
    configs = {mode: app_config(mode, pair, args) for mode in modes}
    controller = next((config["controller"] for mode, config in configs.items() if mode != "nospec"), None)
    report.doc["notes"] += [
        f"Constructed {args.shape} pair, agreement {AGREEMENT}; prompts of {args.prompt_len} random tokens, "
        f"{args.output_len} output tokens, greedy, ignore_eos; max_num_seqs {args.max_num_seqs}, L starts at "
        f"{DRAFT_LEN}; controller {json.dumps(controller)} (spec and unified; nospec has nothing to control).",
        f"poisson: {args.rate_factor} x nospec's completed requests/s at c{max(concurrencies)}, the same "
        "arrival times for every mode. Each closed loop sends 2 x C requests (4 at C = 1; at least "
        f"{args.min_measured_requests} at C > 1), after an unmeasured one of {args.settle_requests_per_slot} x C (at least {3 * args.single_requests}) at the same C."]
    trace: list[dict] = []
    report.doc["controller_trace"] = trace
    top = f"c{max(concurrencies)}"
    for index, mode in enumerate(modes):
        share_s = (deadline_s - time.monotonic()) / (len(modes) - index)
        # nospec runs first and fixes the rate; the others get its rate and arrival times (none: skipped, as
        # a rate taken from a load this app does not have).
        rate_rps = report.doc.get("poisson_rate_rps")
        poisson = ({"rate_of": top, "factor": args.rate_factor} if mode == "nospec" else
                   {"arrivals": OpenLoop(rate_rps)} if rate_rps else {"rate_of": f"nospec {top}"})
        run = report.serve(mode, configs[mode], port, controller_loads(requests, concurrencies, args, poisson),
                           time.monotonic() + share_s, None if mode == "nospec" else controller_sampler(trace, mode))
        if mode == "nospec":
            nospec = next((point.summary for load, point in run.points if load.name == top), None)
            report.doc["poisson_rate_rps"] = args.rate_factor * nospec.request_throughput_rps if nospec else None
        report.doc["checks"] = controller_checks(report, [m for m in modes if m != "nospec"],
                                                 [f"c{c}" for c in concurrencies] + ["poisson"])
        report.doc["table:What the controller saw and set, per point (means over 0.5 s samples)"] = \
            trace_by_point(report, trace)
        report.write()
    plot_controller(report, trace, args.out / "controller_L.png")
    report.write()


# ---- part 5: API extras --------------------------------------------------------------------------

EXTRAS = {  # load name -> the request fields it adds to plain greedy requests
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    # Under a grammar the output ends where the grammar does: ignore_eos is refused with one.
    "json_schema": {"ignore_eos": False,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "doc", "schema": JSON_SCHEMA}}},
    "plain_again": {},
}


def extras_checks(report: Report) -> list[dict]:
    """Each extra's tok/s over the mean of the two plain points (before and after: drift shows as their gap)."""
    plains = [v for v in (tok_s(report, "extras", "plain"), tok_s(report, "extras", "plain_again")) if v]
    plain = float(np.mean(plains)) if plains else None
    checks = []
    for name, goal in GOALS["extras"].items():
        value = ratio(tok_s(report, "extras", name), plain)
        checks.append({"load": name, "x_plain": value, "goal": f"{goal[0]} {goal[1]}", "verdict": verdict(value, goal),
                       "acceptance_rate": row_of(report, "extras", name).get("acceptance")})
    return checks


def part_extras(args: argparse.Namespace, report: Report, port: int, deadline_s: float) -> None:
    pair = grammar_pair(saved_pair(args))
    c, n = args.extras_concurrency, args.extras_requests
    requests = random_requests(pair.vocab_size, n * len(EXTRAS) + args.max_num_seqs, args.prompt_len, args.output_len,
                               SEED + 5)
    loads = [Load("warmup", requests[: args.max_num_seqs], OpenLoop(float("inf")), measured=False)]
    for i, (name, extra) in enumerate(EXTRAS.items()):
        # Prompts of each load's own: none reads another's prefix cache.
        part = requests[args.max_num_seqs + i * n: args.max_num_seqs + (i + 1) * n]
        loads.append(Load(name, part, ClosedLoop(c), options=RequestOptions(extra_body=extra)))
    report.doc["notes"] += [
        f"One unified app, L = {DRAFT_LEN}, controller off; {n} requests per load at {c} in flight, prompts of "
        f"{args.prompt_len} random tokens, {args.output_len} output tokens, greedy. Fields per load: "
        f"{json.dumps(EXTRAS)}.",
        "The pair: constructed, agreement 0.8, its tokenizer with ids 0-7 renamed (end token and JSON's characters: "
        "grammar_pair). The schema's one string field holds the model's own tokens; json_schema requests end at "
        "max_tokens or where the grammar closes the object (their tok/s counts the tokens they produced)."]
    report.serve("extras", app_config("unified", pair, args), port, loads, deadline_s)
    report.doc["checks"] = extras_checks(report)
    report.write()


# ---- part 2 (c): prefix caching ------------------------------------------------------------------

def prefix_checks(report: Report, modes: list[str]) -> list[dict]:
    checks = []
    for mode in modes:
        off, on = row_of(report, f"{mode}-cache-off", "shared"), row_of(report, f"{mode}-cache-on", "shared")
        value = ratio(off.get("ttft_ms p50"), on.get("ttft_ms p50"))
        goal = GOALS["prefix"]["ttft_p50 off / on"]
        checks.append({"mode": mode, "ttft_p50_ms off": off.get("ttft_ms p50"),
                       "ttft_p50_ms on": on.get("ttft_ms p50"), "off / on": value,
                       "goal": f"{goal[0]} {goal[1]}", "verdict": verdict(value, goal)})
    return checks


def part_prefix(args: argparse.Namespace, report: Report, port: int, deadline_s: float) -> None:
    pair = saved_pair(args)
    modes = args.modes.split(",")
    max_model_len = args.prefix_tokens + args.suffix_tokens + args.prefix_output_len + 64
    report.doc["notes"] += [
        f"Requests share one system prompt of {args.prefix_tokens} random tokens, each with {args.suffix_tokens} "
        f"tokens of its own after it, {args.prefix_output_len} output tokens, greedy; {args.prefix_requests} "
        f"requests at {args.prefix_concurrency} in flight after a warm-up of 2 requests with the same prefix "
        "(the cache-on apps meet the prefix there first). engine.enable_prefix_caching on against off, max_model_len "
        f"{max_model_len}, one app each, modes {modes} (pdv prefills in its prefill lane: the prefix must be found "
        "there). Each app draws the same requests: only the cache differs."]
    apps = [(mode, cache) for mode in modes for cache in ("off", "on")]
    for index, (mode, cache) in enumerate(apps):
        share_s = (deadline_s - time.monotonic()) / (len(apps) - index)
        requests = shared_prefix_requests(pair.vocab_size, args.prefix_requests + 2, args.prefix_tokens,
                                          args.suffix_tokens, args.prefix_output_len, SEED + 9)
        loads = [Load("warmup", requests[:2], ClosedLoop(1), measured=False),
                 Load("shared", requests[2:], ClosedLoop(args.prefix_concurrency))]
        engine = {"enable_prefix_caching": cache == "on", "max_model_len": max_model_len,
                  "max_num_seqs": max(args.prefix_concurrency, 8)}
        name = f"{mode}-cache-{cache}"
        report.serve(name, app_config(mode, pair, args, engine=engine), port, loads, time.monotonic() + share_s)
        report.doc["checks"] = prefix_checks(report, modes)
        report.write()


# ---- part 4: the n-gram drafter ------------------------------------------------------------------

def ngram_checks(report: Report, concurrencies: list[int]) -> list[dict]:
    checks = []
    for workload in ("copy", "plain"):
        for c in concurrencies:
            load = f"{workload}_c{c}"
            value = ratio(tok_s(report, "ngram", load), tok_s(report, "nospec", load))
            goal = GOALS["ngram"]["plain"] if workload == "plain" else None
            checks.append({"load": load, "x_nospec": value, "goal": f"{goal[0]} {goal[1]}" if goal else "(report)",
                           "verdict": verdict(value, goal) if goal else "",
                           "acceptance_rate": row_of(report, "ngram", load).get("acceptance"),
                           "mean_acceptance_length": row_of(report, "ngram", load).get("accept_len")})
    return checks


def part_ngram(args: argparse.Namespace, report: Report, port: int, deadline_s: float) -> None:
    pair = saved_pair(args)
    concurrencies = [int(c) for c in args.ngram_concurrencies.split(",")]
    # 4 x C: at 16 in flight, 2 x C (32 requests, ~2 s) left a 4 % gap between two runs of one path.
    count = {c: args.single_requests if c == 1 else 4 * c for c in concurrencies}
    max_model_len = args.ngram_doc_tokens + 9 + args.ngram_output_len + 64
    report.doc["notes"] += [
        f"copy: the prompt is a document of {args.ngram_doc_tokens} tokens of the target's own chain, 8 random "
        "tokens, and the document's first token; the target's greedy output then repeats the document "
        f"({args.ngram_output_len} output tokens). plain: {args.prompt_len} random prompt tokens, "
        f"{args.output_len} output tokens (the output's n-grams are not in the prompt). Requests per point: "
        f"{count}. nospec against unified with draft {{method: ngram}} (prompt_lookup 2-5), L = {DRAFT_LEN}; "
        f"max_model_len {max_model_len}."]
    for index, (name, mode, ngram) in enumerate((("nospec", "nospec", False), ("ngram", "unified", True))):
        share_s = (deadline_s - time.monotonic()) / (2 - index)
        warm = random_requests(pair.vocab_size, 8, args.prompt_len, 8, SEED + 20)
        loads = [Load("warmup", warm, OpenLoop(float("inf")), measured=False)]
        for c in concurrencies:
            loads.append(Load(f"copy_c{c}", copy_requests(pair.successor, count[c], args.ngram_doc_tokens,
                                                           args.ngram_output_len, SEED + 30 + c), ClosedLoop(c)))
            loads.append(Load(f"plain_c{c}", random_requests(pair.vocab_size, count[c], args.prompt_len,
                                                             args.output_len, SEED + 40 + c), ClosedLoop(c)))
        engine = {"max_model_len": max_model_len, "max_num_seqs": max(max(concurrencies), 8)}
        report.serve(name, app_config(mode, pair, args, engine=engine, ngram=ngram), port, loads,
                     time.monotonic() + share_s)
        report.doc["checks"] = ngram_checks(report, concurrencies)
        report.write()


# ---- main ----------------------------------------------------------------------------------------

SERVED_PARTS = {"controller": part_controller, "extras": part_extras, "prefix": part_prefix, "ngram": part_ngram}
DEFAULT_MODES = {"controller": "nospec,spec,unified", "prefix": "unified,pdv"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__, budget_s=540.0)
    parser.add_argument("--part", required=True, choices=(*SERVED_PARTS, "paged", "families"))
    parser.add_argument("--modes", default=None, help="controller: nospec first (it sets the Poisson rate), "
                        "default nospec,spec,unified; prefix: default unified,pdv")
    parser.add_argument("--controller", default="{}", help="JSON merged into the controller block (controller part)")
    parser.add_argument("--rate-factor", type=float, default=0.9,
                        help="controller: Poisson at this x nospec's completed requests/s at the most in flight")
    parser.add_argument("--min-load-s", type=float, default=15.0, help="a load starts only with this much left")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the most in flight, at least 8")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: prompt + output + 64")
    for key, value in PRESETS["cuda"].items():
        if key in ("dtype",):
            continue
        parser.add_argument("--" + key.replace("_", "-"), type=type(value), default=None,
                            help=f"default {value} on cuda, {PRESETS['cpu'][key]} on cpu")
    args, rest = parser.parse_known_args(argv)
    for key, value in PRESETS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.rest = rest
    args.modes = args.modes or DEFAULT_MODES.get(args.part, "")
    args.max_num_seqs = args.max_num_seqs or max(8, *(int(c) for c in args.concurrencies.split(",")))
    args.max_model_len = args.max_model_len or args.prompt_len + args.output_len + 64
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part in ("paged", "families"):  # in process, no Ray: their own scripts, with the same flags
        module = "paged_capacity" if args.part == "paged" else "families_fused"
        script = importlib.import_module(f"benchmarks.{module}")
        script.main(["--device", args.device, "--out", str(args.out), "--budget-s", str(args.budget_s),
                     "--pair-dir", str(args.pair_dir), *args.rest])
        return
    if args.rest:
        raise SystemExit(f"unknown arguments for part {args.part}: {args.rest}")
    deadline_s = time.monotonic() + args.budget_s - 20  # the shutdown and the last write
    report = Report(args.part, args, argv)
    port = start_model_cluster()
    log(f"Ray and Serve up (port {port}); part {args.part}, budget {args.budget_s:.0f} s")
    try:
        SERVED_PARTS[args.part](args, report, port, deadline_s)
    finally:
        report.write()
        serve.shutdown()
        ray.shutdown()
    log(f"done: {args.out / args.part}.json / .md; checks {json.dumps(report.doc['checks'])}")


if __name__ == "__main__":
    main()
