"""Speculation under a grammar's mask: acceptance with and without it, on the shipped pair, CPU.

The same prompts are generated, in ONE run, as free text and under a JSON schema and JSON mode
(`json_object`), greedily and sampled (temperature 1, seeded), with the draft model at L = 2 and 4,
and without speculation. Reported per variant: the acceptance rate (accepted / drafted tokens, vLLM's
definition), the mean acceptance length (tokens per verify step), output tokens per second of the
engine, and for the masked runs that every output parses (and matches the schema) and that greedy
output is the same with speculation as without. Then the mask's own cost, apart from the engine:
microseconds per bitmask fill (xgrammar, host) along the greedy outputs, and per masking of a
[8, 5, V] logits tensor (the verify forward's at L = 4).

    python benchmarks/grammar_acceptance_cpu.py --out benchmarks/results/grammar_acceptance_cpu
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jsonschema  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import git_commit, load_average, machine  # noqa: E402
from deployments.config import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from lanes.engine.core import EngineConfig, EngineCore  # noqa: E402
from lanes.model.loader import load_model  # noqa: E402
from lanes.sample.grammar import apply_token_bitmask  # noqa: E402
from lanes.sample.params import SamplingParams, StructuredOutput  # noqa: E402

PROMPTS = ["config = ", "def load_settings(path):\n    return ", "import json\n\nDEFAULTS = ", "    data = ",
           "person = ", "    return {", "response = requests.get(url)\nitem = ", "CONFIG = json.loads('''"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "version": {"type": "integer"}, "debug": {"type": "boolean"},
    "paths": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "version", "debug", "paths"]}
FORMATS = {"free text": None, "json_schema": StructuredOutput("json", json.dumps(SCHEMA), "response_format"),
           "json_object": StructuredOutput("json_object", "", "response_format")}
MAX_TOKENS = {"free text": 64, "json_schema": 256, "json_object": 256}


def run(target, draft, draft_len: int, fmt: str, temperature: float, tokenizer) -> dict:
    config = EngineConfig(max_model_len=512, max_num_seqs=len(PROMPTS), num_speculative_tokens=draft_len)
    core = EngineCore.colocated(target, draft if draft_len else None, config)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(str(i), tokenizer.encode(prompt), SamplingParams(
            max_tokens=MAX_TOKENS[fmt], temperature=temperature, seed=i, structured=FORMATS[fmt]))
    outputs = {str(i): [] for i in range(len(PROMPTS))}
    reasons = {}
    start = time.perf_counter()
    while core.has_work:
        for out in core.step():
            outputs[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    seconds = time.perf_counter() - start
    texts = [tokenizer.decode(outputs[str(i)], skip_special_tokens=True) for i in range(len(PROMPTS))]
    stats = core.total_stats
    return {"format": fmt, "draft_len": draft_len, "temperature": temperature,
            "acceptance_rate": stats.acceptance_rate if stats.num_draft_tokens else None,
            "mean_acceptance_length": 1 + stats.num_accepted_tokens / stats.num_drafts if stats.num_drafts else 1.0,
            "num_draft_tokens": stats.num_draft_tokens, "num_accepted_tokens": stats.num_accepted_tokens,
            "output_tokens": sum(map(len, outputs.values())), "seconds": seconds,
            "tokens_per_s": sum(map(len, outputs.values())) / seconds,
            "finished_by_grammar": sum(r == "stop" for r in reasons.values()), "valid": valid(fmt, texts, reasons),
            "texts": texts}


def valid(fmt: str, texts: list[str], reasons: dict) -> int | None:
    """Outputs that parse (and match the schema) among those the grammar ended."""
    if fmt == "free text":
        return None
    count = 0
    for i, text in enumerate(texts):
        if reasons[str(i)] != "stop":
            continue
        doc = json.loads(text)
        if fmt == "json_schema":
            jsonschema.validate(doc, SCHEMA)
        count += isinstance(doc, dict)
    return count


def mask_cost_us(target, rows: list[dict]) -> dict:
    """Median microseconds of one fill along each masked format's greedy outputs, and of one masking."""
    core = EngineCore.colocated(target, None, EngineConfig(max_model_len=512, max_num_seqs=1))
    out = {}
    for fmt in ("json_schema", "json_object"):
        texts = next(r["texts"] for r in rows if r["format"] == fmt and r["temperature"] == 0.0)
        times = []
        for text in texts:
            grammar = core.grammars.for_request(SamplingParams(structured=FORMATS[fmt]))
            bitmask = torch.empty(1, grammar.words, dtype=torch.int32)
            for token in core.tokenizer.encode(text):
                start = time.perf_counter()
                grammar.fill(bitmask, 0)
                times.append(time.perf_counter() - start)
                assert grammar.matcher.accept_token(token)
        out[f"fill {fmt}"] = statistics.median(times) * 1e6
    logits = torch.randn(8, 5, core.vocab_size)
    bitmask = torch.full((8, 5, (core.vocab_size + 31) // 32), -1, dtype=torch.int32)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        apply_token_bitmask(logits, bitmask)
        times.append(time.perf_counter() - start)
    out["apply [8, 5, V]"] = statistics.median(times) * 1e6
    return out


def report(rows: list[dict]) -> str:
    lines = ["| format | temperature | L | acceptance rate | mean acceptance length | output tok/s | ended by grammar "
             "| valid |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        lines.append(f"| {r['format']} | {r['temperature']} | {r['draft_len']} | {rate} | "
                     f"{r['mean_acceptance_length']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['finished_by_grammar']}/{len(PROMPTS)} | {'-' if r['valid'] is None else r['valid']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft = load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)
    tokenizer = target.tokenizer
    rows = []
    for temperature in (0.0, 1.0):
        for fmt in FORMATS:
            for draft_len in (0, 2, 4):
                rows.append(run(target, draft, draft_len, fmt, temperature, tokenizer))
                print(report(rows[-1:]).splitlines()[-1], flush=True)
    for fmt in ("json_schema", "json_object"):  # lossless: greedy output with speculation = without
        greedy = [r["texts"] for r in rows if r["format"] == fmt and r["temperature"] == 0.0]
        assert all(t == greedy[0] for t in greedy), f"{fmt}: greedy output differs with speculation"
    cost = mask_cost_us(target, rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine(), "commit": git_commit(), "load_average": load_average(),
            "command": "python benchmarks/grammar_acceptance_cpu.py --out " + str(args.out), "prompts": PROMPTS,
            "schema": SCHEMA, "max_tokens": MAX_TOKENS}
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows, "mask_cost_us": cost}, indent=1))
    args.out.with_suffix(".md").write_text(
        f"# Acceptance under a grammar's mask (CPU, shipped pair)\n\n`{meta['command']}` at {meta['commit']}, "
        f"load average {meta['load_average']}.\n{len(PROMPTS)} prompts per row, batched; greedy output with "
        f"speculation equals greedy output without it for both masked formats (checked). Output tok/s: one run "
        f"of about a second per row on a shared 2-core CPU, rough.\n\n{report(rows)}\n\nMask cost, median "
        f"microseconds: " + ", ".join(f"{k} {v:.1f}" for k, v in cost.items()) + "\n")
    print(report(rows))
    print(cost)


if __name__ == "__main__":
    main()
