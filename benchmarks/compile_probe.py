"""Probe for issue 7's next step: does torch.compile (Inductor fusing norms, rotary, residual adds
and activations) shorten the draft forward inside our CUDA graphs? Times the TinyLlama-shaped
draft forward (random bf16 weights, context 512) as the engine runs it today and with the graph
body compiled, in one run.

    python benchmarks/compile_probe.py --out DIR
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

from benchmarks.gpu_check import CONTEXT, TINYLLAMA, decode_forward_ms  # noqa: E402
from lanes.engine.core import EngineConfig, build_runner  # noqa: E402
from lanes.model.cuda_graphs import GraphedForward  # noqa: E402
from lanes.model.loader import build_random_model  # noqa: E402


def probe_logits(runner) -> torch.Tensor:
    """Logits of 8 rows at fixed slots and inputs (same KV each time), [8, 1, V]."""
    slots = list(range(8))
    runner.pool.reserve(slots, [CONTEXT + 1] * 8)  # no-op after the first call
    for s in slots:
        runner.pool.lengths[s] = CONTEXT
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, runner.vocab_size, (8, 1), generator=gen).cuda()
    return runner.forward(runner.rows(slots, [CONTEXT] * 8), ids).clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    config = EngineConfig(max_model_len=CONTEXT + 8, max_num_seqs=64, prefill_chunk_tokens=64, idle_prefill_tokens=64)
    model = build_random_model(TINYLLAMA, dtype="bfloat16", device="cuda").model
    runner = build_runner(model, config)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    eager = {b: decode_forward_ms(runner, b) for b in args.batches}
    probe = probe_logits(runner)
    compiled_body = torch.compile(runner._logits, dynamic=False)
    runner.graphs = GraphedForward(compiled_body, runner.pool.pad_slot, runner.device, runner.pool.shape.num_slots)
    compiled = probe_logits(runner)
    result["max_abs_logit_diff"] = float((compiled - probe).abs().max())
    result["same_argmax_share"] = float((compiled.argmax(-1) == probe.argmax(-1)).float().mean())
    print({k: result[k] for k in ("max_abs_logit_diff", "same_argmax_share")}, flush=True)
    for batch in args.batches:
        start = time.perf_counter()
        ms = decode_forward_ms(runner, batch)  # first call compiles and captures
        row = {"batch": batch, "graphed_ms": round(eager[batch], 3), "graphed_compiled_ms": round(ms, 3),
               "speedup": round(eager[batch] / ms, 2), "compile_and_measure_s": round(time.perf_counter() - start, 1)}
        result["rows"].append(row)
        print(row, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "compile_probe.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
