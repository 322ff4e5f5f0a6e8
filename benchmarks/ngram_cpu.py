"""N-gram (prompt-lookup) drafting against no speculation, single stream, on the shipped target, CPU.

Prompts ask the target to edit or continue Python standard-library code taken from this Python
install (`inspect.getsource`): a function's source, then either a comment asking for an edited copy
of it and the copy's first line, or the first line of a sibling function of the same module. The
target writes the rest, copying much of the prompt, which is what prompt lookup drafts. In ONE run, every prompt is generated greedily by:
  - nospec: the engine with no speculation (the baseline every ratio is taken against),
  - ngram L: the engine drafting by prompt lookup (prompt_lookup_min/max 2/5), L = 2, 4, 6,
  - draft L=4: the engine with the shipped draft model, for reference.
Variants alternate within each repeat, so load from other processes hits all of them alike; the
decode rate of a variant is the median over repeats of tokens after the first / time after the first.

    python benchmarks/ngram_cpu.py --out benchmarks/results/ngram_cpu
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "0")

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import git_commit, load_average, machine  # noqa: E402
from benchmarks.single_stream import engine_run  # noqa: E402
from deployments.config import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from lanes.engine.core import EngineConfig, EngineCore  # noqa: E402
from lanes.model.loader import LoadedModel, load_model  # noqa: E402
from lanes.spec.ngram import NgramProposer  # noqa: E402

# (stdlib function, what the prompt asks for, the first line of the answer: the target writes the rest).
# Edits copy the function with a change; continuations write its sibling in the same module.
TASKS = [
    ("textwrap.indent", "# Same function, renamed to indent_lines:\n", "def indent_lines(text, prefix, predicate=None):\n"),
    ("shutil.copyfileobj", "# Same function, renamed to copy_stream:\n", "def copy_stream(fsrc, fdst, length=0):\n"),
    ("fnmatch.filter", "# Same function, renamed to filter_names:\n", "def filter_names(names, pat):\n"),
    ("calendar.monthrange", "# Same function, renamed to month_range:\n", "def month_range(year, month):\n"),
    ("string.capwords", "# Same function, with type hints:\n", "def capwords(s: str, sep: str | None = None) -> str:\n"),
    ("colorsys.rgb_to_hls", "", "def hls_to_rgb(h, l, s):\n"),
    ("colorsys.hls_to_rgb", "", "def rgb_to_hsv(r, g, b):\n"),
]
PROMPT_LOOKUP = (2, 5)


def stdlib_source(dotted: str) -> str:
    module_name, name = dotted.rsplit(".", 1)
    return inspect.getsource(getattr(__import__(module_name, fromlist=[name]), name))


def build_prompts(tokenizer, max_prompt_tokens: int) -> list[dict]:
    prompts = []
    for dotted, ask, first_line in TASKS:
        text = f"{stdlib_source(dotted)}\n\n{ask}{first_line}"
        ids = tokenizer.encode(text)
        assert len(ids) <= max_prompt_tokens, f"{dotted}: {len(ids)} tokens"
        prompts.append({"source": dotted, "text": text, "ids": ids})
    return prompts


def make_engine(target: LoadedModel, draft: LoadedModel | None, draft_len: int, ngram: bool,
                max_model_len: int) -> EngineCore:
    config = EngineConfig(max_model_len=max_model_len, max_num_seqs=1, num_speculative_tokens=draft_len,
                          max_draft_len=max(draft_len, 1), prefill_chunk_tokens=max_model_len,
                          idle_prefill_tokens=max_model_len)
    proposer = NgramProposer(*PROMPT_LOOKUP) if ngram else None
    return EngineCore.colocated(target, draft, config, proposer=proposer)


def variants(draft: LoadedModel) -> dict:
    """name -> (draft model, L, prompt lookup)"""
    out = {"nospec": (None, 0, False)}
    out.update({f"ngram L={n}": (None, n, True) for n in (2, 4, 6)})
    out["draft L=4"] = (draft, 4, False)
    return out


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    target = load_model(args.target, "float32", "cpu")
    draft = load_model(args.draft, "float32", "cpu")
    prompts = build_prompts(target.tokenizer, args.max_model_len - args.new_tokens)
    runs = variants(draft)
    rates: dict[str, dict[str, list[float]]] = {name: {p["source"]: [] for p in prompts} for name in runs}
    first: dict[str, dict[str, dict]] = {name: {} for name in runs}
    for name, (d, n, ngram) in runs.items():  # warm-up: first forwards of each shape
        engine_run(make_engine(target, d, n, ngram, args.max_model_len), prompts[0]["ids"][:64], 8, "cpu")
    for repeat in range(args.repeats):
        for p in prompts:
            for name, (d, n, ngram) in runs.items():
                out = engine_run(make_engine(target, d, n, ngram, args.max_model_len), p["ids"], args.new_tokens,
                                 "cpu")
                rates[name][p["source"]].append(out["decode_tok_s"])
                first[name].setdefault(p["source"], out)
        print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    return summarize(prompts, runs, rates, first)


def summarize(prompts, runs, rates, first) -> dict:
    base = {p["source"]: statistics.median(rates["nospec"][p["source"]]) for p in prompts}
    rows, per_prompt = [], []
    for name in runs:
        medians = {s: statistics.median(r) for s, r in rates[name].items()}
        drafted = sum(first[name][s]["stats"]["num_draft_tokens"] for s in medians)
        accepted = sum(first[name][s]["stats"]["num_accepted_tokens"] for s in medians)
        drafts = sum(first[name][s]["stats"]["num_drafts"] for s in medians)
        same = sum(first[name][s]["tokens"] == first["nospec"][s]["tokens"] for s in medians)
        # Single-stream speed-up over the prompts: total tokens / total time, each at its median rate.
        tokens = [len(first[name][s]["tokens"]) - 1 for s in medians]
        mean_rate = sum(tokens) / sum(t / medians[s] for t, s in zip(tokens, medians))
        base_rate = sum(tokens) / sum(t / base[s] for t, s in zip(tokens, medians))
        rows.append({"variant": name, "decode_tok_s": round(mean_rate, 1), "ratio_vs_nospec": round(mean_rate / base_rate, 3),
                     "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                     "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
                     "draft_tokens": drafted, "accepted_tokens": accepted, "steps_with_drafts": drafts,
                     "outputs_equal_to_nospec": f"{same}/{len(medians)}"})
        for s in medians:
            st = first[name][s]["stats"]
            per_prompt.append({"variant": name, "prompt": s, "decode_tok_s": round(medians[s], 1),
                               "ratio_vs_nospec": round(medians[s] / base[s], 3),
                               "acceptance_rate": round(st["acceptance_rate"], 3) if st["acceptance_rate"] else None,
                               "same_output_as_nospec": first[name][s]["tokens"] == first["nospec"][s]["tokens"]})
    return {"rows": rows, "per_prompt": per_prompt,
            "prompts": [{"source": p["source"], "tokens": len(p["ids"]), "text": p["text"]} for p in prompts]}


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# N-gram (prompt-lookup) drafting on the shipped target, CPU, single stream",
        "",
        f"`python benchmarks/ngram_cpu.py --out benchmarks/results/ngram_cpu` at {meta['commit']}, on "
        f"{meta['machine']['cpu_model']} ({meta['machine']['cpu_cores']} cores, shared with other work; load "
        f"average {meta['load_average_before']} before, {meta['load_average_after']} after), torch threads "
        f"{meta['threads']}. Greedy, {meta['new_tokens']} new tokens per prompt, {len(result['prompts'])} prompts, "
        f"median of {meta['repeats']} repeats. Every ratio is against nospec measured in the same run, "
        "its runs interleaved with the others.",
        "",
        "| variant | decode tok/s | × nospec | acceptance rate | mean acceptance length | outputs equal to nospec |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {r['decode_tok_s']} | {r['ratio_vs_nospec']} | {r['acceptance_rate']} | "
                     f"{r['mean_acceptance_length']} | {r['outputs_equal_to_nospec']} |")
    lines += ["", "Per prompt (ratio against nospec on the same prompt, acceptance rate):", "",
              "| prompt | tokens | " + " | ".join(r["variant"] for r in result["rows"][1:]) + " |",
              "| --- | --- |" + " --- |" * (len(result["rows"]) - 1)]
    by = {(r["variant"], r["prompt"]): r for r in result["per_prompt"]}
    for p in result["prompts"]:
        cells = [f"{by[(r['variant'], p['source'])]['ratio_vs_nospec']}× / {by[(r['variant'], p['source'])]['acceptance_rate']}"
                 for r in result["rows"][1:]]
        lines.append(f"| `{p['source']}` | {p['tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    args = parser.parse_args()
    before = load_average()
    start = time.time()
    result = measure(args)
    result["meta"] = {"commit": git_commit(), "machine": machine(), "threads": args.threads,
                      "new_tokens": args.new_tokens, "repeats": args.repeats, "prompt_lookup": PROMPT_LOOKUP,
                      "load_average_before": before, "load_average_after": load_average(),
                      "wall_s": round(time.time() - start, 1)}
    text = markdown(result)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
