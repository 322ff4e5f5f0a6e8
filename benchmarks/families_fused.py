"""Qwen3-, Gemma-2- and Mistral-shaped models on the fused path, on one GPU: step times and greedy equality.

    python3 benchmarks/families_fused.py --out OUT [--budget-s 240]                      (one GPU)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/families_fused.py --device cpu --out /tmp/ff   (dry run)

Steps: a decode forward of each released checkpoint's shape (SHAPES, random bf16 weights), fused, on the HF
fallback and in HF eager, against gpu_check.py's floor; greedy: the engine against HF's `generate` at the test
size (float32; on cpu the steps too). Writes families.json and .md after each family; method: docs/gpu_runs.md.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.cluster import STARTED_S, free_device_memory, git_commit, log, machine  # noqa: E402
from benchmarks.lib.results import rows_table, script_parser, write_document  # noqa: E402

CONTEXT = 512
BATCHES = (1, 64)
FLOOR_GOAL = 1.6  # fused step / floor at batch 1
GREEDY_PROMPT_LENS = [1, 9, 23, 25, 40, 77, 120, 150]  # the window of the test configs is 24 tokens
MAX_NEW = 16
_NO_SPECIAL = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
SHAPES = {  # released checkpoints' shapes; no Gemma-2 of 7B was released
    "qwen3": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                  num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, **_NO_SPECIAL),  # Qwen3-8B
    "gemma2": dict(model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                   num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                   query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, max_position_embeddings=8192, **_NO_SPECIAL),  # Gemma-2-9B
    "mistral": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    sliding_window=4096, max_position_embeddings=32768, **_NO_SPECIAL),  # Mistral-7B-v0.1
}
TEST_CONFIGS = {"qwen3": "qwen3", "gemma2": "gemma2", "mistral": "mistral_window"}  # tests/test_model_families.py


def step_rows(name: str, config: dict, args: argparse.Namespace, bandwidth_gbs: float | None) -> list[dict]:
    """Decode forward times of one family at each batch: fused, HF fallback, HF eager (cuda), the floor."""
    from benchmarks.gpu_check import decode_forward_ms, floor_ms, hf_eager_ms, random_model
    from lanes.engine.core import EngineConfig, build_runner

    model = random_model(config, args.dtype, args.device).model
    parameters = sum(p.numel() for p in model.parameters())
    rows = {b: {"family": name, "batch": b, "parameters_b": round(parameters / 1e9, 2)} for b in BATCHES}
    for path, fused in (("fused", None), ("hf_fallback", False)):
        runner = build_runner(model, EngineConfig(max_model_len=CONTEXT + 8, max_num_seqs=max(BATCHES),
                                                  fused_layers=fused))
        for b in BATCHES:
            rows[b][f"{path}_path"] = "fused" if runner.fused is not None else "hf modules"
            rows[b][f"{path}_ms"] = round(decode_forward_ms(runner, b, CONTEXT), 2)
        del runner
        free_device_memory()
    for b, row in rows.items():
        if args.device == "cuda":
            row["hf_eager_ms"] = round(hf_eager_ms(model, b, 1), 2)
        if bandwidth_gbs:
            row["floor_ms"] = round(floor_ms(model, b, CONTEXT, bandwidth_gbs), 2)
            row["fused_over_floor"] = round(row["fused_ms"] / row["floor_ms"], 2)
        row["fallback_over_fused"] = round(row["hf_fallback_ms"] / row["fused_ms"], 2)
    del model
    free_device_memory()
    return list(rows.values())


def greedy_row(name: str, device: str) -> dict:
    """The engine's greedy output against HF's, test-size config of the family, float32 on `device`."""
    from lanes.model.loader import build_random_model
    from lanes.sample.params import SamplingParams
    from tests.conftest import perturbed_copy
    from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion, small_engine
    from tests.test_model_families import FAMILIES, VOCAB, WINDOW

    target = build_random_model(FAMILIES[TEST_CONFIGS[name]], dtype="float32", seed=1)
    draft = perturbed_copy(target, 0.3, seed=2)
    target.model.to(device)
    draft.model.to(device)
    target.model.set_attn_implementation("eager")  # HF's SDPA path drops Gemma-2's attention soft-capping
    prompts = [random_prompts(1, VOCAB, n, n, seed=20 + n)[0] for n in GREEDY_PROMPT_LENS]
    refs = [hf_greedy(target, p, MAX_NEW) for p in prompts]
    engine = small_engine(target, draft, num_speculative_tokens=3)
    outputs = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
                                         for i, p in enumerate(prompts)})
    equal = [outputs[str(i)] == ref for i, ref in enumerate(refs)]
    runner = engine.verifier.lane.runner
    return {"family": name, "config": TEST_CONFIGS[name], "prompts": len(prompts),
            "past_window": sum(n > WINDOW for n in GREEDY_PROMPT_LENS), "equal_to_hf_greedy": sum(equal),
            "unequal_prompt_lens": [n for n, ok in zip(GREEDY_PROMPT_LENS, equal) if not ok],
            "path": "fused" if runner.fused is not None else "hf modules",
            "attention_kernel": bool(getattr(runner, "attention_kernel", False)),
            "cuda_graphs": getattr(runner, "graphs", None) is not None,
            "acceptance_rate": round(engine.total_stats.acceptance_rate or 0, 3)}


def markdown(doc: dict) -> str:
    m = doc["machine"]
    return "\n".join([
        f"# Model families on the fused path ({m.get('gpu') or m['cpu_model']})", "",
        f"`{doc['command']}`, commit {doc['commit']}, {time.monotonic() - STARTED_S:.0f} s; copy bandwidth "
        f"{doc.get('copy_bandwidth_gbs')} GB/s.", "",
        f"## Decode forward at context {CONTEXT} (ms, median of 10); goal fused <= {FLOOR_GOAL} x floor at batch 1", "",
        rows_table(doc["steps"]), "## Greedy output against HF's (test-size configs, float32)", "",
        rows_table(doc["greedy"])])


def main() -> None:
    parser = script_parser(__doc__, budget_s=240.0)  # --pair-dir: unused (random weights)
    parser.add_argument("--families", default="qwen3,gemma2,mistral")
    args = parser.parse_args()
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.device == "cuda":
        os.environ["TRITON_INTERPRET"] = "0"  # before tests' conftest would turn the interpreter on
    from tests.test_model_families import FAMILIES

    deadline_s = STARTED_S + args.budget_s - 10
    doc = {"command": "python3 benchmarks/families_fused.py " + " ".join(sys.argv[1:]), "commit": git_commit(),
           "machine": machine(), "steps": [], "greedy": [], "skipped": []}
    if args.device == "cuda":
        from benchmarks.gpu_check import copy_bandwidth_gbs

        doc["copy_bandwidth_gbs"] = round(copy_bandwidth_gbs(), 1)
    for name in args.families.split(","):
        # Greedy first: cheap, and the correctness answer matters more than a step time.
        doc["greedy"].append(greedy_row(name, args.device))
        log(f"{name} greedy: {json.dumps(doc['greedy'][-1])}")
        write_document(args.out, "families", doc, markdown(doc))
        if time.monotonic() > deadline_s - 60:
            doc["skipped"].append(f"{name} steps: out of time")
            continue
        config = SHAPES[name] if args.device == "cuda" else FAMILIES[TEST_CONFIGS[name]]
        doc["steps"] += step_rows(name, config, args, doc.get("copy_bandwidth_gbs"))
        log(f"{name} steps: {json.dumps(doc['steps'][-len(BATCHES):])}")
        write_document(args.out, "families", doc, markdown(doc))
    log("done")


if __name__ == "__main__":
    main()
