"""One request at a time: how fast does speculation make a single stream, at full model shapes
with a known acceptance? Runs, in one process and one run:
  - the co-located engine without a draft (nospec) and with one (spec, L = 2, 4, 6),
  - HF transformers `generate` on the target alone (eager, DynamicCache) as the outside reference,
on constructed pairs (docs/constructed_pair.md) at agreement 0.5 and 0.8. Greedy, a prompt of
random tokens, N new tokens; decode rate = tokens after the first / time after the first.

    python benchmarks/single_stream.py --shape tinyllama-7b --device cuda --out DIR   (GPU machine)
    python benchmarks/single_stream.py --shape small --device cpu                      (smoke run)
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.constructed_pair import build_constructed_pair, shape_configs  # noqa: E402
from lanes.engine.core import EngineConfig, EngineCore  # noqa: E402
from lanes.sample.params import SamplingParams  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine_run(engine: EngineCore, prompt: list[int], new_tokens: int, device: str) -> dict:
    """Generate once; returns tokens, time to first token and decode rate."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    engine.add_request("r", prompt, params)
    tokens, first_at = [], None
    while engine.has_work:
        for out in engine.step():
            tokens += out.token_ids
            if first_at is None and out.token_ids:
                first_at = time.perf_counter()
    end = time.perf_counter()
    return {"tokens": tokens, "ttft_ms": (first_at - start) * 1e3,
            "decode_tok_s": (len(tokens) - 1) / (end - first_at), "stats": engine.total_stats.to_dict()}


def hf_run(model, prompt: list[int], new_tokens: int, device: str) -> dict:
    ids = torch.tensor([prompt], device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    model.generate(ids, **{**kwargs, "max_new_tokens": 1, "min_new_tokens": 1})  # prefill timing alone
    sync(device)
    start = time.perf_counter()
    model.generate(ids, **{**kwargs, "max_new_tokens": 1, "min_new_tokens": 1})
    sync(device)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    sync(device)
    total_s = time.perf_counter() - start
    return {"tokens": out[0, len(prompt):].tolist(), "decode_tok_s": (new_tokens - 1) / (total_s - prefill_s)}


def measure(args: argparse.Namespace, agreement: float) -> dict:
    target_cfg, draft_cfg = shape_configs(args.shape)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    target, draft = build_constructed_pair(target_cfg, draft_cfg, agreement, dtype=dtype, device=args.device)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target_cfg["vocab_size"], (args.prompt_len,), generator=gen).tolist()
    config = dict(max_model_len=args.prompt_len + args.new_tokens + 8, max_num_seqs=1,
                  prefill_chunk_tokens=args.prompt_len, idle_prefill_tokens=args.prompt_len)
    row = {"agreement": agreement}
    runs = {"nospec": (None, 0)} | {f"spec_L{n}": (draft, n) for n in args.draft_lens}
    for name, (drafter, draft_len) in runs.items():
        engine_cfg = EngineConfig(**config, num_speculative_tokens=draft_len, max_draft_len=max(args.draft_lens))
        engine_run(EngineCore.colocated(target, drafter, engine_cfg), prompt, args.new_tokens, args.device)  # warm-up
        row[name] = engine_run(EngineCore.colocated(target, drafter, engine_cfg), prompt, args.new_tokens, args.device)
    row["hf_eager"] = hf_run(target.model, prompt, args.new_tokens, args.device)
    reference = row["nospec"]["tokens"]
    for name in [*runs, "hf_eager"]:
        row[name]["equal_to_nospec"] = row[name].pop("tokens") == reference
        row[name]["speedup_vs_nospec"] = round(row[name]["decode_tok_s"] / row["nospec"]["decode_tok_s"], 3)
        row[name]["speedup_vs_hf"] = round(row[name]["decode_tok_s"] / row["hf_eager"]["decode_tok_s"], 3)
    del target, draft
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tinyllama-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--agreement", type=float, nargs="+", default=[0.5, 0.8])
    parser.add_argument("--draft-lens", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"shape": args.shape, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "rows": [measure(args, a) for a in args.agreement]}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "single_stream.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
