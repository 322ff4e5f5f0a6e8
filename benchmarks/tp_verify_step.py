"""Tensor parallelism against one device: greedy output and the verify step, TP = N against TP = 1
(docs/tensor_parallel.md, "Measuring it on GPUs"). Writes OUT/tp_verify_step.json.

    python benchmarks/tp_verify_step.py --tp 2 --shape llama2-7b --out benchmarks/results/tp_h100x2   # N GPUs
    python benchmarks/tp_verify_step.py --tp 2 --shape tiny --device cpu --dtype float32 --out /tmp/tp   # gloo
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # tests/conftest.py (imported) sets it for the CPU; GPUs compile

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_check import CONTEXT, LLAMA2_7B, random_model, timed_ms, verify_step  # noqa: E402
from lanes.engine.core import EngineConfig, EngineCore  # noqa: E402
from lanes.parallel.worker import worker_processes  # noqa: E402
from lanes.sample.params import SamplingParams  # noqa: E402
from lanes.spec.verify import VerifyLane  # noqa: E402
from tests.conftest import ARCH_CONFIGS  # noqa: E402
from tests.engine_helpers import random_prompts, run_to_completion  # noqa: E402

SHAPES = {"llama2-7b": LLAMA2_7B, "tiny": ARCH_CONFIGS["llama"]}
DRAFTS = 4
BATCHES = (1, 8, 32, 64)


def engine_config() -> EngineConfig:
    return EngineConfig(max_model_len=CONTEXT + 8, max_num_seqs=max(BATCHES), num_speculative_tokens=0,
                        prefill_chunk_tokens=256, idle_prefill_tokens=1024)


def load_on_worker(shape: str, dtype: str, device_type: str):
    """A worker's loader (lanes.parallel.worker.Loader): its device is cuda:<rank> on GPUs."""
    device = f"cuda:{torch.distributed.get_rank()}" if device_type == "cuda" else "cpu"
    return engine_config(), [random_model(SHAPES[shape], dtype, device).model], (True,)


def measure(engine: EngineCore) -> dict:
    """The engine's greedy output for 8 random prompts, then the verify step's time at each batch
    (greedy drafts, the median of 10 after one warm-up)."""
    lane = VerifyLane(engine.verifier.lane.runner)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(8, lane.runner.vocab_size, 16, 200, seed=7)
    outputs = list(run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)}).values())
    verify_ms = {b: timed_ms(lane.pool, *verify_step(lane, b, DRAFTS, draft_probs=False)) for b in BATCHES}
    return {"outputs": outputs, "verify_ms": {b: round(ms, 3) for b, ms in verify_ms.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    devices = [f"cuda:{r}" if args.device == "cuda" else "cpu" for r in range(args.tp)]
    one = measure(EngineCore.colocated(random_model(SHAPES[args.shape], args.dtype, devices[0]), None, engine_config()))
    torch.cuda.empty_cache()  # the TP = 1 engine is gone: give its memory back to rank 0's shard (CPU: no-op)
    with worker_processes(args.tp, partial(load_on_worker, args.shape, args.dtype, args.device), devices) as tp:
        target = random_model(SHAPES[args.shape], args.dtype, devices[0])
        sharded = measure(EngineCore.colocated(target, None, engine_config(), tp=tp))
    result = {
        "shape": args.shape, "dtype": args.dtype, "device": args.device, "tp": args.tp, "context": CONTEXT,
        "drafts": DRAFTS, "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "greedy_prompts_equal": sum(a == b for a, b in zip(one["outputs"], sharded["outputs"])),
        "greedy_prompts": len(one["outputs"]),
        "verify_ms_tp1": one["verify_ms"], f"verify_ms_tp{args.tp}": sharded["verify_ms"],
        "ratio": {b: round(sharded["verify_ms"][b] / one["verify_ms"][b], 3) for b in BATCHES},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tp_verify_step.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
