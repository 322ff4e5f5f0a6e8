"""Where a verify step and a draft step spend GPU time: torch.profiler over a few replays, kernels
grouped by kind (Llama-2-7B verify at batch 64 with 4 drafts, TinyLlama draft at batch 1, L = 4),
random bf16 weights, context 512; the reading is in docs/performance.md.

    python benchmarks/profile_steps.py --out DIR      (writes profile_steps.json and prints tables)
"""

import os

os.environ["TRITON_INTERPRET"] = "0"  # the test helpers imported below would turn the interpreter on

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_check import (CONTEXT, LLAMA2_7B, TINYLLAMA, fill_pool, kv_bytes, random_bf16,  # noqa: E402
                                  step_config)
from lanes.engine.core import EngineConfig, build_runner  # noqa: E402
from lanes.engine.sequence import Sequence  # noqa: E402
from lanes.sample.params import SamplingParams  # noqa: E402
from lanes.spec.draft import DraftLane  # noqa: E402
from lanes.spec.verify import VerifyBatch, VerifyLane  # noqa: E402

KINDS = (("attention (pool kernel)", ("_split_kernel", "_merge_kernel")), ("GEMM", ("gemm", "Gemm", "sm90", "cutlass", "nvjet")),
         ("fused norm / rotary+KV write / act-mul", ("_add_rms_norm_kernel", "_rope_store_kernel", "_act_mul_kernel")),
         ("KV write (index_put)", ("index_put", "indexing")), ("elementwise / norm / rotary", ("elementwise", "reduce", "vectorized")),
         ("copies", ("Memcpy", "copy")))


def classify(name: str) -> str:
    return next((kind for kind, keys in KINDS if any(k in name for k in keys)), "other")


def profile_fn(fn, steps: int = 5) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    kernels = 0
    for evt in prof.key_averages():
        device_us = getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
        if device_us <= 0:
            continue
        kernels += evt.count
        kind = classify(evt.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + device_us / steps / 1e3
    events = prof.events()
    device_times = [(e.time_range.start, e.time_range.end) for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    span_ms = (max(e for _, e in device_times) - min(s for s, _ in device_times)) / steps / 1e3 if device_times else None
    busy_ms = sum(by_kind.values())
    return {"gpu_busy_ms_per_step": round(busy_ms, 3), "gpu_span_ms_per_step": round(span_ms, 3) if span_ms else None,
            "kernels_per_step": kernels // steps, "by_kind_ms": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}}


def bandwidth_shares(profile: dict, model, batch: int, forwards: int) -> dict:
    """GB/s the GEMMs reach on the weights they read (embeddings excluded: a lookup reads B rows) and
    the attention kernel on the KV at CONTEXT, over the step's forwards."""
    embed = model.get_input_embeddings().weight
    gemm_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    kv = kv_bytes(model.config.to_dict(), batch, CONTEXT, embed.element_size())
    by_kind = profile["by_kind_ms"]
    gbs = {"GEMM": gemm_bytes * forwards / (by_kind.get("GEMM", 0) or float("nan")) / 1e6,
           "attention (pool kernel)": kv * forwards / (by_kind.get("attention (pool kernel)", 0) or float("nan")) / 1e6}
    return {**profile, "achieved_gbs": {k: round(v, 1) for k, v in gbs.items()}}


def profile_verify(config: EngineConfig) -> dict:
    target = random_bf16(LLAMA2_7B)
    lane = VerifyLane(build_runner(target, config))
    slots = fill_pool(lane.runner, 64, CONTEXT - 1)
    drafts = torch.randint(0, 32000, (64, 4), device="cuda")
    batch = VerifyBatch(slots, [CONTEXT] * 64, [1] * 64, drafts, None, [4] * 64, [SamplingParams()] * 64, list(range(64)))

    def verify():
        for s in slots:
            lane.pool.lengths[s] = CONTEXT - 1
        lane.verify(batch)

    return bandwidth_shares(profile_fn(verify), target, 64, 1)


def profile_draft(config: EngineConfig) -> dict:
    draft = random_bf16(TINYLLAMA)
    runner = build_runner(draft, config)
    slot = fill_pool(runner, 1, CONTEXT - 1)[0]
    seq = Sequence("0", list(range(1, CONTEXT + 1)), SamplingParams(), 0, 4, draft_slot=slot)
    lane = DraftLane(runner)

    def propose():
        runner.pool.lengths[slot] = CONTEXT - 1
        lane.propose([seq], [4]).tokens.cpu()

    return bandwidth_shares(profile_fn(propose), draft, 1, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gpu")
    args = parser.parse_args()
    config = step_config(CONTEXT + 8, 64)
    result = {"device": torch.cuda.get_device_name()}
    result["verify_7b_b64_l4"] = profile_verify(config)
    print("verify", result["verify_7b_b64_l4"], flush=True)
    torch.cuda.empty_cache()
    result["draft_tinyllama_b1_l4"] = profile_draft(config)
    print("draft", result["draft_tinyllama_b1_l4"], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_steps.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
