"""What the host part of a copied KV hand-over costs: one Ray actor call carrying a prompt's KV,
as a torch tensor (torch's own pickling) against `HostKV` (bytes out-of-band), on this machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_serialization.py --out benchmarks/results/kv_serialization_cpu.json

Sizes are the Llama-2-7B shape's target KV (0.5 MiB a token in bf16) at several prompt lengths.
The receiver turns what it got into a tensor and reads one element, as the verify lane's
`load_kv` does before its device copy; the device copies on either side are not included.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deployments.kv_transfer import HostKV  # noqa: E402

LLAMA2_7B_KV = (2, 32, 32, 128)  # (k/v, layers, kv_heads, head_dim): tokens go in between


@ray.remote(num_cpus=0)
class Receiver:
    def take_tensor(self, kv: torch.Tensor) -> float:
        return float(kv.view(-1)[-1])

    def take_host(self, kv: HostKV) -> float:
        return float(kv.tensor("cpu").view(-1)[-1])


def kv_of(tokens: int) -> torch.Tensor:
    two, layers, heads, dim = LLAMA2_7B_KV
    return torch.randn(two, layers, heads, tokens, dim).to(torch.bfloat16)


def call_ms(fn, arg, repeats: int) -> float:
    ray.get(fn.remote(arg))  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ray.get(fn.remote(arg))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    receiver = Receiver.remote()
    rows = []
    for tokens in args.tokens:
        kv = kv_of(tokens)
        torch_ms = call_ms(receiver.take_tensor, kv, args.repeats)
        start = time.perf_counter()
        host = HostKV.from_tensor(kv)
        to_host_ms = (time.perf_counter() - start) * 1e3
        host_ms = call_ms(receiver.take_host, host, args.repeats)
        rows.append({"prompt_tokens": tokens, "kv_mib": kv.numel() * 2 / 2**20, "torch_tensor_call_ms": round(torch_ms, 2),
                     "host_kv_call_ms": round(host_ms, 2), "host_kv_wrap_ms": round(to_host_ms, 3),
                     "speedup": round(torch_ms / host_ms, 1)})
        print(rows[-1], flush=True)
    ray.shutdown()
    result = {"machine": {"cpu_cores": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                          "ray": ray.__version__, "load_average_1m": os.getloadavg()[0]},
              "repeats": args.repeats, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
