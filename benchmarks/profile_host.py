"""Host time of one engine step: 64 running requests, no speculation against speculation with L drafts.

By default the models are tiny (hidden 64), so their compute is negligible and what is timed is
the engine's own host work per step: Python over sequences, tensors built from lists, host syncs.
The pair is constructed (docs/constructed_pair.md), so the draft agrees with the target on a known
share of tokens, as in the GPU benchmarks. Prints the median ms per `EngineCore.step()` without a
draft and with one, the ms outside the model forwards, where the spec step's time goes (section
timers), and a cProfile top-N of the spec step; `--out` writes the numbers as JSON. The same code
runs on a GPU (`--device cuda`, CUDA graphs as served), also at full shapes (`--shape tinyllama-7b`).

    OMP_NUM_THREADS=1 python benchmarks/profile_host.py [--device cuda] [--shape tinyllama-7b] [--out DIR]
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.constructed_pair import build_constructed_pair, shape_configs  # noqa: E402
from lanes.engine.core import EngineConfig, EngineCore  # noqa: E402
from lanes.sample.params import SamplingParams  # noqa: E402

TINY_TARGET = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   eos_token_id=None, bos_token_id=None, pad_token_id=None)
TINY_DRAFT = {**TINY_TARGET, "num_hidden_layers": 1}


class Sections:
    """Wall time spent inside chosen callables, per step (instance-level wrappers; nesting allowed)."""

    def __init__(self):
        self.spent_s: dict[str, float] = {}

    def wrap(self, owner, attr: str, label: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent_s[label] = self.spent_s.get(label, 0.0) + time.perf_counter() - start
        setattr(owner, attr, timed)


def instrument(engine: EngineCore) -> Sections:
    sections = Sections()
    sections.wrap(engine.verifier.lane.runner, "forward", "model forwards")
    sections.wrap(engine.verifier, "verify", "verify (incl. its forward and the device-to-host copy)")
    sections.wrap(engine, "_append", "postprocess: EngineCore._append (outside this work)")
    if engine.draft is not None:
        sections.wrap(engine.draft, "forward", "model forwards")
        sections.wrap(engine.proposer, "propose", "draft: propose (incl. its forwards)")
    return sections


def filled_engine(pair, speculate: bool, args) -> EngineCore:
    """An engine with `args.batch` requests past prefill, all decoding, none close to finishing."""
    target, draft = pair
    steps = args.warmup_steps + args.steps + args.profile_steps
    max_model_len = args.prompt_len + 1 + steps * (args.draft_len + 1) + 8  # none finishes while timed
    config = EngineConfig(max_model_len=max_model_len, max_num_seqs=args.batch, num_speculative_tokens=args.draft_len,
                          max_draft_len=max(args.draft_len, 1), prefill_chunk_tokens=2048, idle_prefill_tokens=8192)
    engine = EngineCore.colocated(target, draft if speculate else None, config)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    for i in range(args.batch):
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
        params = SamplingParams(max_tokens=max_model_len - args.prompt_len, ignore_eos=True,
                                temperature=args.temperature, seed=i)
        engine.add_request(str(i), prompt, params)
    while len(engine.scheduler.running) < args.batch:
        engine.step()
    return engine


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_steps(engine: EngineCore, steps: int, device: str, sections: Sections) -> tuple[list[float], dict[str, float]]:
    """Wall ms of each step, and the median ms per step inside each section."""
    times, per_section = [], []
    for _ in range(steps):
        sync(device)
        sections.spent_s.clear()
        start = time.perf_counter()
        engine.step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        per_section.append(dict(sections.spent_s))
    labels = {label for s in per_section for label in s}
    medians = {label: statistics.median(s.get(label, 0.0) * 1e3 for s in per_section) for label in sorted(labels)}
    medians["outside the model forwards"] = statistics.median(
        t - s.get("model forwards", 0.0) * 1e3 for t, s in zip(times, per_section))
    return times, medians


def profile_top(engine: EngineCore, steps: int, device: str, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    sync(device)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shape", default="tiny", choices=("tiny", "small", "tinyllama-7b"))
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    parser.add_argument("--batch", type=int, default=64, help="requests in flight")
    parser.add_argument("--draft-len", type=int, default=3, help="L of the spec run")
    parser.add_argument("--agreement", type=float, default=0.8, help="designed greedy agreement of the pair")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: seeded sampling")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25, help="functions in the printed profile")
    parser.add_argument("--out", type=Path, default=None, help="directory for profile_host.json")
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    torch.set_num_threads(1)
    configs = (TINY_TARGET, TINY_DRAFT) if args.shape == "tiny" else shape_configs(args.shape)
    pair = build_constructed_pair(*configs, args.agreement, dtype=dtype, device=args.device)

    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "shape": args.shape,
              "dtype": dtype, "batch": args.batch, "draft_len": args.draft_len, "temperature": args.temperature,
              "agreement": args.agreement, "steps": args.steps}
    for name, speculate in (("nospec", False), ("spec", True)):
        engine = filled_engine(pair, speculate, args)
        sections = instrument(engine)
        run_steps(engine, args.warmup_steps, args.device, sections)
        times, medians = run_steps(engine, args.steps, args.device, sections)
        assert len(engine.scheduler.running) == args.batch, "a request finished during the timed steps"
        step = statistics.median(times)
        result[name] = {"step_ms": round(step, 3), "min_ms": round(min(times), 3),
                        "sections_ms": {k: round(v, 3) for k, v in medians.items()}}
        print(f"{name}: median {step:.2f} ms / step (min {min(times):.2f}, max {max(times):.2f}; "
              f"{args.steps} steps, batch {args.batch})")
        for label, ms in medians.items():
            print(f"    {label:<58} {ms:7.2f} ms")
        if speculate:
            stats = engine.total_stats
            result["spec"]["acceptance_rate"] = stats.acceptance_rate
            result["spec"]["mean_acceptance_length"] = stats.mean_acceptance_length
            print(f"    acceptance rate {stats.acceptance_rate:.2f}, mean acceptance length "
                  f"{stats.mean_acceptance_length:.2f}")
            top = profile_top(engine, args.profile_steps, args.device, args.top)
        del engine, sections  # the next engine's pools need the memory
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    result["spec_over_nospec_step"] = round(result["spec"]["step_ms"] / result["nospec"]["step_ms"], 3)
    print(f"spec step / nospec step: {result['spec_over_nospec_step']:.2f}\n\ncProfile of the spec step:\n{top}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_host.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
