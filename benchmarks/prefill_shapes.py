"""What a prefill forward costs the first time a prompt length is seen, against a repeat of it.

On one H200, gpu_modes.py's prefill lane took 132-160 ms a forward of one or two ~130-token prompts
at its first loads and 37 ms at its last, which repeats an earlier load's prompts. This probe runs
the prefill lane's own code (lanes/spec/prompt_prefiller.py, random-weight Llama-2-7B target and
TinyLlama draft, bf16, no Ray, nothing else on the GPU) over prompt lengths it has not seen, then
over the same lengths again, with the SDPA backends the lanes allow (lanes/model/attention.py) and with
cuDNN's or the math backend alone in their place, and names the attention kernels that ran.

    python benchmarks/prefill_shapes.py --out DIR      (writes prefill_shapes.json)
"""

import os

os.environ["TRITON_INTERPRET"] = "0"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lanes.model.attention  # noqa: E402
from benchmarks.gpu_check import LLAMA2_7B, TINYLLAMA  # noqa: E402
from lanes.engine.core import EngineConfig, build_runner  # noqa: E402
from lanes.model.loader import build_random_model  # noqa: E402
from lanes.sample.params import SamplingParams  # noqa: E402
from lanes.spec.prompt_prefiller import PrefillRequest, PromptPrefiller  # noqa: E402

BACKENDS = {"lanes": lanes.model.attention.SDPA_BACKENDS, "cudnn": [SDPBackend.CUDNN_ATTENTION],
            "math": [SDPBackend.MATH]}


def timed_ms(prefiller: PromptPrefiller, lengths: list[int], backend) -> list[float]:
    """One forward per entry: a batch of prompts of these lengths (an int: one prompt)."""
    out = []
    for n, entry in enumerate(lengths):
        rows = entry if isinstance(entry, list) else [entry]
        requests = [PrefillRequest(f"{n}-{i}", torch.randint(1, 32000, (L,)).tolist(), SamplingParams(), i)
                    for i, L in enumerate(rows)]
        lanes.model.attention.SDPA_BACKENDS = backend
        torch.cuda.synchronize()
        start = time.perf_counter()
        prefiller.prefill(requests)
        torch.cuda.synchronize()
        out.append(round((time.perf_counter() - start) * 1e3, 2))
    return out


def attention_kernels(prefiller: PromptPrefiller, length: int, backend) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_ms(prefiller, [length], backend)
    keys = ("attention", "fmha", "flash", "cudnn", "sdpa", "softmax", "bmm")
    return {e.key[:120]: e.count for e in prof.key_averages() if any(k in e.key.lower() for k in keys)}


def summary(first: list[float], repeat: list[float]) -> dict:
    return {"first_ms_median": statistics.median(first), "repeat_ms_median": statistics.median(repeat),
            "first_ms": first, "repeat_ms": repeat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = EngineConfig(max_model_len=1024, max_num_seqs=8, prefill_chunk_tokens=1024, idle_prefill_tokens=1024)
    with torch.device("cuda"):
        target = build_random_model(LLAMA2_7B, dtype="bfloat16", device="cuda").model
        draft = build_random_model(TINYLLAMA, dtype="bfloat16", device="cuda").model
    prefiller = PromptPrefiller(build_runner(target, config), build_runner(draft, config), 1024)
    timed_ms(prefiller, [64, 128, 96], BACKENDS["lanes"])  # first CUDA and Triton use, outside any measurement
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "backends": {}}
    for i, (name, backend) in enumerate(BACKENDS.items()):
        singles = [101 + 24 * k + i for k in range(16)]  # lengths no earlier backend used
        batches = [[131 + 24 * k + i + 3 * j for j in range(6)] for k in range(6)]
        try:
            result["backends"][name] = {
                "one_prompt": summary(timed_ms(prefiller, singles, backend), timed_ms(prefiller, singles, backend)),
                "six_prompts": summary(timed_ms(prefiller, batches, backend), timed_ms(prefiller, batches, backend)),
                "kernels": attention_kernels(prefiller, 999 - i, backend)}
        except RuntimeError as exc:  # a backend this GPU or these shapes do not support
            result["backends"][name] = {"error": str(exc)[:300]}
        print(name, json.dumps({k: v if k == "error" else {m: v[m] for m in v if m.endswith("median")}
                                for k, v in result["backends"][name].items() if k != "kernels"}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_shapes.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
