"""The pool attention kernel alone, on a GPU: paged blocks of several sizes against one block per slot
(the contiguous layout, same kernel) and, with --slot-ref, against the slot-pool kernel that paging
replaced (bb76a15, a checkout made as docs/gpu_runs.md says); each with the split kernel's launch
settings swept: issue 31's 2 (d) (paged verify step <= 1.05x contiguous) on the GPU's side, where a
paged forward differs from the slot code's only in this kernel (the host's side of a step:
verify_step_profile.py).

    python3 benchmarks/attention_kernel.py --out OUT [--slot-ref results/tmp/slot_ref]

Shapes: Llama-2-7B's attention (32 heads, 32 KV heads, head dim 128) at Q = 5 (verify, 4 drafts) and
Q = 1 (decode), TinyLlama's (32 / 4 / 64) at Q = 1 (the drafter); batch 1-64, context 512 as in
gpu_check.py's step table, pools of 576 tokens a row. Paged blocks are handed out in a shuffled order.
Each time is the median of CUDA-graph replays (triton.testing.do_bench_cudagraph): the GPU's time, no
launch overhead. `floor_us`: the keys and values read once at the copy bandwidth measured in the same
run. Every layout's output is checked against the contiguous one before it is timed.
Writes attention_kernel.json and attention_kernel.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # tests set the interpreter; here the kernels compile for the GPU

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.gpu_check import copy_bandwidth_gbs  # noqa: E402
from lanes.model.triton_attention import pool_attention, split_count  # noqa: E402

SHAPES = {"Llama-2-7B": (32, 32, 128), "TinyLlama-1.1B": (32, 4, 64)}  # query heads, KV heads, head dim
POINTS = [("Llama-2-7B", 5), ("Llama-2-7B", 1), ("TinyLlama-1.1B", 1)]
BATCHES = (1, 8, 32, 64)
CONTEXT = 512
CAPACITY = 576  # tokens a row's pool holds (gpu_check's max_model_len 520, rounded up to whole key steps)
BLOCK_SIZES = (16, 32, 64, 192)  # each divides CAPACITY
# (keys a step, num_warps, num_stages)
LAUNCHES = [(n, w, s) for n, (w, s) in itertools.product((16, 32, 64), ((4, 2), (4, 3), (4, 4), (8, 3)))]
DEFAULT_LAUNCH = (64, 4, 2)


def paged(dense: torch.Tensor, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dense [rows, kv_heads, capacity, D] -> blocks [rows * n, kv_heads, block_size, D] in a shuffled
    order, block table [rows, n] int32."""
    rows, heads, capacity, dim = dense.shape
    n = capacity // block_size
    ordered = dense.view(rows, heads, n, block_size, dim).transpose(1, 2).reshape(rows * n, heads, block_size, dim)
    perm = torch.randperm(rows * n, generator=torch.Generator().manual_seed(seed)).to(dense.device)
    blocks = torch.empty_like(ordered)
    blocks[perm] = ordered
    return blocks, perm.view(rows, n).to(torch.int32)


def slot_kernel(path: str):
    """The slot-pool `pool_attention` of the checkout at `path` (lanes/triton_attention.py there)."""
    spec = importlib.util.spec_from_file_location("slot_ref_attention", Path(path) / "lanes" / "triton_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.pool_attention


def time_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def point_rows(shape: str, q_len: int, batch: int, bandwidth_gbs: float, slot_ref, num_sms: int) -> list[dict]:
    heads, kv_heads, dim = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(batch * 10 + q_len)
    k = torch.randn(batch, kv_heads, CAPACITY, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, kv_heads, CAPACITY, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    query = torch.randn(batch, heads, q_len, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    rows_ = torch.arange(batch, device="cuda")
    # As in gpu_check.py: a verify step finds 511 tokens and writes 5, a decode step finds 512.
    kv_lens = torch.full((batch,), CONTEXT - 1 if q_len > 1 else CONTEXT, dtype=torch.int32, device="cuda")
    scale = dim**-0.5
    splits = split_count(CAPACITY, batch, kv_heads, num_sms)
    keys_read = batch * kv_heads * (int(kv_lens[0]) + q_len) * dim * 2 * 2  # K and V, bf16
    floor_us = keys_read / (bandwidth_gbs * 1e9) * 1e6
    layouts = {"contiguous (one block a row)": CAPACITY, **{f"paged, blocks of {b}": b for b in BLOCK_SIZES}}
    launches = LAUNCHES if shape == "Llama-2-7B" else [(n, 4, s) for n in (16, 32, 64) for s in (2, 3)]
    base = dict(shape=shape, q=q_len, batch=batch, splits=splits, floor_us=round(floor_us, 1))
    out, reference = [], None
    for layout, block_size in layouts.items():
        k_blocks, table = paged(k, block_size, seed=1)
        v_blocks, _ = paged(v, block_size, seed=1)
        for block_n, warps, stages in launches:
            def run(n=block_n, w=warps, s=stages):
                return pool_attention(query, k_blocks, v_blocks, table, rows_, kv_lens, scale, splits,
                                      num_warps=w, num_stages=s, block_n=n)

            result = run()
            reference = result if reference is None else reference
            torch.testing.assert_close(result, reference, rtol=2e-2, atol=2e-2)
            us = time_us(run)
            out.append({**base, "layout": layout, "block_size": block_size, "block_n": block_n, "num_warps": warps,
                        "num_stages": stages, "us": round(us, 1), "over_floor": round(us / floor_us, 2)})
        del k_blocks, v_blocks
    if slot_ref is not None:
        torch.testing.assert_close(slot_ref(query, k, v, rows_, kv_lens, scale, splits), reference, rtol=2e-2, atol=2e-2)
        us = time_us(lambda: slot_ref(query, k, v, rows_, kv_lens, scale, splits))
        out.append({**base, "layout": "slot pool (bb76a15's kernel)", "block_size": None, "block_n": 64,
                    "num_warps": 4, "num_stages": 3, "us": round(us, 1), "over_floor": round(us / floor_us, 2)})
    return out


def markdown(rows: list[dict], bandwidth_gbs: float, device: str, command: str) -> str:
    lines = [f"# Pool attention kernel alone ({device})", "", f"`{command}`; copy bandwidth {bandwidth_gbs:.0f} GB/s.",
             "Microseconds a call (split and merge kernels, CUDA-graph replays, median), context "
             f"{CONTEXT}, pools of {CAPACITY} tokens a row. The first figure is the default launch (64 keys a step, "
             "num_warps 4, num_stages 2); 'best' the fastest of the sweep, with (keys a step, warps, stages). "
             "Ratios against the slot-pool kernel where it ran.", ""]
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    lines += ["| shape | Q | batch | floor us | " + " | ".join(layouts) + " |",
              "|---|---|---|---|" + "---|" * len(layouts)]
    for key, group in itertools.groupby(rows, key=lambda r: (r["shape"], r["q"], r["batch"])):
        group = list(group)
        slot = next((r["us"] for r in group if r["block_size"] is None), None)
        cells = []
        for layout in layouts:
            mine = [r for r in group if r["layout"] == layout]
            default = next((r for r in mine if (r["block_n"], r["num_warps"], r["num_stages"]) == DEFAULT_LAUNCH),
                           mine[0])  # the slot-pool kernel ran at its own launch
            best = min(mine, key=lambda r: r["us"])
            cell = f"{default['us']}"
            if slot and default["block_size"] is not None:
                cell += f" ({default['us'] / slot:.2f}x)"
            if best is not default:
                cell += f"; best {best['us']} ({best['block_n']}, {best['num_warps']}, {best['num_stages']})"
                if slot:
                    cell += f" ({best['us'] / slot:.2f}x)"
            cells.append(cell)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {group[0]['floor_us']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--slot-ref", default=None, help="a checkout of bb76a15 (its lanes/triton_attention.py)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth_gbs()
    slot_ref = slot_kernel(args.slot_ref) if args.slot_ref else None
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for (shape, q_len), batch in itertools.product(POINTS, BATCHES):
        rows += point_rows(shape, q_len, batch, bandwidth, slot_ref, num_sms)
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(0)
    command = "python3 benchmarks/attention_kernel.py --out OUT" + (f" --slot-ref {args.slot_ref}" if args.slot_ref else "")
    (out / "attention_kernel.json").write_text(json.dumps({"device": device, "bandwidth_gbs": bandwidth,
                                                           "rows": rows}, indent=1))
    (out / "attention_kernel.md").write_text(markdown(rows, bandwidth, device, command))
    print(markdown(rows, bandwidth, device, command))


if __name__ == "__main__":
    main()
