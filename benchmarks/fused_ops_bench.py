"""The fused elementwise kernels (lanes/model/fused_ops.py) on one GPU: each kernel's time at served shapes,
against the same kernels of another revision of that file (`--baseline`), in the same run.

    git show <rev>:lanes/model/fused_ops.py > /tmp/fused_ops_base.py
    python3 benchmarks/fused_ops_bench.py --baseline /tmp/fused_ops_base.py --out OUT      (one GPU)

Shapes: residual add + RMSNorm over Llama-2-7B's and TinyLlama's hidden rows, Qwen3-8B's per-head q/k norm
(rows of 128), rotary + KV-pool write of Llama-2-7B (32 query and 32 KV heads), Llama-3-8B / Qwen3-8B
(32 and 8) and TinyLlama (32 and 4, head_dim 64), SiLU-and-multiply of 7B's and TinyLlama's MLPs; at 1, 64
and 320 tokens (decode at batch 1 and 64, verify of 64 rows of 5) and 4,096 (a prefill chunk). bf16.
Each kernel time is the median of `triton.testing.do_bench_cudagraph` (the kernel replayed in a CUDA graph,
as served: no launch cost), and each row counts the output elements where this file's kernels and the
baseline's differ. Then whole forwards through the fused decoder (lanes/model/fused_decoder.py) with either
file's kernels: one prompt's prefill of PREFILL_TOKENS and a decode forward of 64 rows at context 512, for
Llama-2-7B- and Qwen3-8B-shaped models with random bf16 weights (median of 10 after a warm-up,
CUDA-synchronised wall time). Writes fused_ops.json and fused_ops.md under --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

import torch  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.lib.results import rows_table  # noqa: E402
from lanes.model import fused_ops  # noqa: E402

TOKENS = (1, 64, 320, 4096)
NORMS = {"Llama-2-7B hidden (4096)": (4096, 1), "TinyLlama hidden (2048)": (2048, 1),
         "Qwen3-8B q heads (32 x 128)": (128, 32)}  # (row length, rows a token)
ROPES = {"Llama-2-7B (32 / 32 heads x 128)": (32, 32, 128), "Llama-3-8B (32 / 8 x 128)": (32, 8, 128),
         "TinyLlama (32 / 4 x 64)": (32, 4, 64)}
MLPS = {"Llama-2-7B (11008)": 11008, "TinyLlama (5632)": 5632}
PAGE = 16
PREFILL_TOKENS = 2048
CONTEXT = 512


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("fused_ops_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def median_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def compare(kind: str, shape: str, tokens: int, new, old) -> dict:
    """Time both, and count the output elements where they differ (a float32 sum over a row taken in
    another order may round the last bit of a bf16 output the other way)."""
    pairs = list(zip(new(), old()))
    differing = sum(int((a != b).sum()) for a, b in pairs)
    elements = sum(a.numel() for a, _ in pairs)
    max_diff = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
    new_us, old_us = median_us(new), median_us(old)
    return {"kernel": kind, "shape": shape, "tokens": tokens, "new_us": round(new_us, 2),
            "baseline_us": round(old_us, 2), "new_over_baseline": round(new_us / old_us, 3),
            "elements_differing": differing, "elements": elements, "max_abs_diff": max_diff}


def norm_rows(base) -> list[dict]:
    rows = []
    for shape, (length, per_token) in NORMS.items():
        for tokens in TOKENS:
            x = torch.randn(tokens * per_token, length, dtype=torch.bfloat16, device="cuda")
            res = torch.randn_like(x) if per_token == 1 else None  # head norms have no residual
            w = torch.randn(length, dtype=torch.bfloat16, device="cuda")
            rows.append(compare("add_rms_norm", shape, tokens, lambda: fused_ops.add_rms_norm(x, res, w, 1e-6, True),
                                lambda: base.add_rms_norm(x, res, w, 1e-6, True)))
    return rows


def rope_rows(base) -> list[dict]:
    rows = []
    for shape, (q_heads, kv_heads, dim) in ROPES.items():
        for tokens in TOKENS:
            batch, q_len = (tokens, 1) if tokens <= 64 else (64, tokens // 64)
            blocks_per_slot = (CONTEXT + q_len) // PAGE + 1
            qkv = torch.randn(batch, q_len, (q_heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device="cuda")
            cos, sin = (torch.randn(1024, dim // 2, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            table = torch.randperm(batch * blocks_per_slot, device="cuda", dtype=torch.int32).view(batch, -1)
            slots = torch.arange(batch, device="cuda", dtype=torch.int32)
            starts = torch.full((batch,), 500, device="cuda", dtype=torch.int32)
            pools = [torch.zeros(batch * blocks_per_slot, kv_heads, PAGE, dim, dtype=torch.bfloat16, device="cuda")
                     for _ in range(4)]

            def run(module, k_pool, v_pool):
                query = module.rope_store(qkv, cos, sin, table, slots, starts, k_pool, v_pool, q_heads, True)
                return query, k_pool, v_pool

            rows.append(compare("rope_store", shape, tokens, lambda: run(fused_ops, *pools[:2]),
                                lambda: run(base, *pools[2:])))
    return rows


def mlp_rows(base) -> list[dict]:
    rows = []
    for shape, inter in MLPS.items():
        for tokens in TOKENS:
            gate_up = torch.randn(tokens, 2 * inter, dtype=torch.bfloat16, device="cuda")
            rows.append(compare("silu_and_mul", shape, tokens, lambda: [fused_ops.silu_and_mul(gate_up, True)],
                                lambda: [base.silu_and_mul(gate_up, True)]))
    return rows


def use_kernels(module) -> None:
    """Make the fused decoder built next call `module`'s kernels (it binds them when it is built)."""
    from lanes.model import fused_decoder

    for name in ("add_rms_norm", "add_gemma_rms_norm", "rope_store"):
        setattr(fused_decoder, name, getattr(module, name))
    fused_decoder.ACTIVATIONS.update(silu=module.silu_and_mul, gelu_pytorch_tanh=module.gelu_tanh_and_mul)


def forward_ms(runner, batch: int, q_len: int, start: int) -> float:
    """One forward of `batch` rows of `q_len` new tokens after `start` cached ones (median of 10 after a
    warm-up, families_fused's timing)."""
    from benchmarks.families_fused import median_ms

    slots = [runner.pool.allocate() for _ in range(batch)]
    runner.pool.reserve(slots, [start + q_len] * batch)
    ids = torch.randint(0, runner.vocab_size, (batch, q_len), device="cuda")
    ms = median_ms(lambda: runner.forward(runner.rows(slots, [start] * batch), ids), "cuda")
    for slot in slots:
        runner.pool.free(slot)
    return ms


def forward_rows(base) -> list[dict]:
    from benchmarks.families_fused import SHAPES
    from benchmarks.gpu_check import LLAMA2_7B
    from lanes.engine.core import EngineConfig, build_runner
    from lanes.model.loader import build_random_model

    rows = []
    for shape, config in (("Llama-2-7B", LLAMA2_7B), ("Qwen3-8B", SHAPES["qwen3"])):
        with torch.device("cuda"):  # random init on the GPU: seconds, not minutes on the host
            model = build_random_model(config, dtype="bfloat16", device="cuda").model
        times = {}
        for label, module in (("new", fused_ops), ("baseline", base)):
            use_kernels(module)
            # Blocks for 64 rows of CONTEXT + 1 tokens, which also hold one prompt of PREFILL_TOKENS.
            runner = build_runner(model, EngineConfig(max_model_len=PREFILL_TOKENS + 8, max_num_seqs=64,
                                                      prefill_chunk_tokens=PREFILL_TOKENS,
                                                      num_kv_blocks=64 * (CONTEXT // PAGE + 1)))
            assert runner.fused is not None, f"{shape} did not take the fused path"
            times[label] = (forward_ms(runner, 1, PREFILL_TOKENS, 0), forward_ms(runner, 64, 1, CONTEXT))
            del runner
            torch.cuda.empty_cache()
        use_kernels(fused_ops)
        for i, step in enumerate((f"prefill of {PREFILL_TOKENS} tokens", f"decode, 64 rows at {CONTEXT}")):
            new_ms, old_ms = times["new"][i], times["baseline"][i]
            rows.append({"forward": step, "shape": shape, "new_ms": round(new_ms, 3), "baseline_ms": round(old_ms, 3),
                         "new_over_baseline": round(new_ms / old_ms, 3)})
        del model
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="another revision of lanes/model/fused_ops.py")
    parser.add_argument("--out", default="benchmarks/results/fused_ops")
    args = parser.parse_args()
    base = load_baseline(args.baseline)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = {"device": torch.cuda.get_device_name(), "baseline": args.baseline,
                "kernels": norm_rows(base) + rope_rows(base) + mlp_rows(base), "forwards": []}
    write(out, document)  # the kernels' rows kept if the forwards fail
    document["forwards"] = forward_rows(base)
    print(write(out, document))


def write(out: Path, document: dict) -> str:
    (out / "fused_ops.json").write_text(json.dumps(document, indent=2))
    tables = (f"## Kernels (µs)\n\n{rows_table(document['kernels'], labels=3)}\n"
              f"## Whole forwards (ms)\n\n{rows_table(document['forwards'])}")
    title = f"# Fused kernels against {document['baseline']} ({document['device']})"
    (out / "fused_ops.md").write_text(f"{title}\n\n{tables}")
    return tables


if __name__ == "__main__":
    main()
