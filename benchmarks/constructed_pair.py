"""Shape-faithful draft/target pairs whose acceptance is constructed (docs/constructed_pair.md has the
method), then measured by the engine. The CLI builds a pair per agreement, checks its map, and measures
acceptance through the engine's ordinary verification, greedy and at temperature 1:

    python benchmarks/constructed_pair.py --shape small --agreement 0.5 0.8 --out DIR
    python benchmarks/constructed_pair.py --shape tinyllama-7b --agreement 0.5 0.8 --out DIR   (GPU)

Writes DIR/constructed_pair_<shape>.json and prints a table.
"""

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lanes.engine.core import EngineConfig, EngineCore  # noqa: E402
from lanes.model.loader import LoadedModel, build_random_model  # noqa: E402
from lanes.sample.params import SamplingParams  # noqa: E402
from lanes.spec.stats import SpecDecodeStats  # noqa: E402
from tests.engine_helpers import random_prompts, run_to_completion  # noqa: E402

_NO_SPECIAL = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
# A Llama-2-7B / TinyLlama pair scaled down to run on a CPU in seconds: same 32000-token vocabulary
# (a long single successor cycle, so runs rarely revisit tokens), similar ratios, a GQA draft.
SMALL_TARGET = dict(model_type="llama", vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, **_NO_SPECIAL)
SMALL_DRAFT = dict(model_type="llama", vocab_size=32000, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **_NO_SPECIAL)
DEFAULT_SHARPNESS = 16.0  # the successor's logit; the runner-up sits near sharpness * sqrt(2 ln V / hidden)
DEFAULT_RESIDUAL_SCALE = 0.1  # a branch fed unit-RMS activations adds RMS 0.1 to the residual stream
RESIDUAL_OUTPUTS = ("o_proj", "down_proj")  # the projections that write into the residual stream
PROBE_ROWS, PROBE_LEN = 8, 64  # random token rows, and tokens a row, for the fidelity / prediction forwards


def shape_configs(shape: str) -> tuple[dict, dict]:
    """(target config, draft config) for a named shape."""
    if shape == "small":
        return SMALL_TARGET, SMALL_DRAFT
    if shape == "tinyllama-7b":
        # Imported here: gpu_check switches Triton's interpreter off, which only the GPU run wants.
        from benchmarks.gpu_check import LLAMA2_7B, TINYLLAMA
        return LLAMA2_7B, TINYLLAMA
    raise ValueError(f"unknown shape {shape!r}: small or tinyllama-7b")


def successor_maps(vocab_size: int, agreement: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """σ (target) and σ_d (draft), [V] each, both permutations; σ_d == σ on round(agreement * V) tokens.
    A pure function of its arguments, so callers recompute the maps a pair was built with."""
    if not 0 <= agreement <= 1:
        raise ValueError(f"agreement must be in [0, 1], got {agreement}")
    gen = torch.Generator().manual_seed(seed)
    # One cycle through the whole vocabulary: generated text never falls into a short loop, so the
    # tokens a run visits are fresh and each agrees independently with probability `agreement`.
    order = torch.randperm(vocab_size, generator=gen)
    target = torch.empty(vocab_size, dtype=torch.long)
    target[order] = order.roll(-1)
    differ = torch.randperm(vocab_size, generator=gen)[round(agreement * vocab_size):]
    if len(differ) == 1:
        raise ValueError("a single disagreeing token cannot be given another successor: raise or lower agreement")
    draft = target.clone()
    # Each disagreeing token takes the next disagreeing token's successor (a derangement among
    # them): σ_d stays a permutation, so every LM-head row has exactly one predecessor.
    draft[differ] = target[differ.roll(-1)]
    return target, draft


def build_constructed_pair(
    target_config: dict, draft_config: dict, agreement: float, seed: int = 0, dtype: str | torch.dtype = "float32",
    device: str = "cpu", sharpness: float = DEFAULT_SHARPNESS, residual_scale: float = DEFAULT_RESIDUAL_SCALE,
) -> tuple[LoadedModel, LoadedModel]:
    """A (target, draft) pair at the configs' shapes whose greedy drafts agree on a share `agreement`."""
    vocab_size = target_config["vocab_size"]
    if draft_config["vocab_size"] != vocab_size:
        raise ValueError("draft and target must share the vocabulary size")
    successor, draft_successor = successor_maps(vocab_size, agreement, seed)
    common = dict(dtype=dtype, device=device, sharpness=sharpness, residual_scale=residual_scale)
    return (build_constructed_model(target_config, successor, seed=seed, name="constructed-target", **common),
            build_constructed_model(draft_config, draft_successor, seed=seed + 1, name="constructed-draft", **common))


def build_constructed_model(config: dict, successor: torch.Tensor, seed: int, dtype: str | torch.dtype, device: str,
                            sharpness: float, residual_scale: float, name: str) -> LoadedModel:
    """One model whose greedy next token after x is successor[x], whatever the context."""
    # Untied: the head's rows are the successors' predecessors' embeddings, not the embeddings.
    config = {**config, "tie_word_embeddings": False}
    hidden = config["hidden_size"]
    # Built on the device: 7B parameters are not initialised on the CPU and then copied over.
    with torch.device(device):
        model = build_random_model(config, dtype=dtype, device=device, seed=seed).model
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        reinit_layers(model, residual_scale, gen)
        # Embeddings e_x: random rows of RMS 1 (norm sqrt(hidden)), what the first RMSNorm expects. [V, H]
        embeddings = torch.randn(config["vocab_size"], hidden, generator=gen, device=device)
        embeddings = embeddings * (math.sqrt(hidden) / embeddings.norm(dim=-1, keepdim=True))
        # Head row successor[x] = sharpness * e_x / hidden: after the final RMSNorm (norm sqrt(hidden)) the
        # logit of u is sharpness * cos(h, e of u's predecessor). [V, H]
        head = torch.empty_like(embeddings)
        head[successor.to(embeddings.device)] = embeddings * (sharpness / hidden)
        model.get_input_embeddings().weight.copy_(embeddings)
        model.get_output_embeddings().weight.copy_(head)
        # The head assumes the final RMSNorm leaves directions alone: a unit gain, whatever init did.
        model.get_decoder().norm.weight.fill_(1.0)
    assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    return LoadedModel(model, None, name)


def reinit_layers(model: torch.nn.Module, residual_scale: float, gen: torch.Generator) -> None:
    """Random variance-preserving weights (std 1/sqrt(fan_in)), the residual outputs scaled by
    `residual_scale` (HF's fixed std 0.02 would make a branch's size depend on the hidden size)."""
    num_residual = 0
    for name, module in model.get_decoder().layers.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        is_residual = name.endswith(RESIDUAL_OUTPUTS)
        num_residual += is_residual
        scale = residual_scale if is_residual else 1.0
        module.weight.normal_(0.0, scale / math.sqrt(module.in_features), generator=gen)
        if module.bias is not None:
            module.bias.zero_()
    assert num_residual == 2 * len(model.get_decoder().layers), "expected o_proj and down_proj in every layer"


def probe_prompts(vocab_size: int, batch: int, seed: int, length: int = PROBE_LEN) -> torch.Tensor:
    """Uniformly random token rows for probing forwards. [batch, length]"""
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def next_token_logits(model: LoadedModel, prompts: torch.Tensor) -> torch.Tensor:
    """Logits after every position of `prompts` [B, T], float32 on the CPU. [B, T, V]"""
    return model.model(prompts.to(next(model.model.parameters()).device)).logits.float().cpu()


def map_fidelity(model: LoadedModel, successor: torch.Tensor, prompts: torch.Tensor) -> float:
    """Share of positions whose greedy next token is successor[current token]."""
    greedy = next_token_logits(model, prompts).argmax(-1)  # [B, T]
    return (greedy == successor[prompts]).float().mean().item()


@torch.inference_mode()
def residual_share(model: LoadedModel, prompts: torch.Tensor) -> float:
    """RMS of what all layers add to the residual stream (read at the final norm's input), relative to
    the embeddings' RMS: large enough shows the layers work, small enough keeps the map."""
    captured: list[torch.Tensor] = []
    decoder = model.model.get_decoder()
    handle = decoder.norm.register_forward_hook(lambda _module, args, _out: captured.append(args[0]))
    try:
        ids = prompts.to(next(model.model.parameters()).device)
        model.model(ids)
    finally:
        handle.remove()
    embedded = decoder.embed_tokens(ids).float()  # [B, T, H]
    return ((captured[0].float() - embedded).pow(2).mean().sqrt() / embedded.pow(2).mean().sqrt()).item()


def predicted_acceptance(target: LoadedModel, draft: LoadedModel, prompts: torch.Tensor) -> dict[str, float]:
    """Per-token acceptance the verification rule gives: greedy, the share of positions whose argmaxes
    agree; temperature_1, the mean of sum_v min(p, q)."""
    p = next_token_logits(target, prompts).softmax(-1)  # [B, T, V]
    q = next_token_logits(draft, prompts).softmax(-1)
    return {"greedy": (p.argmax(-1) == q.argmax(-1)).float().mean().item(),
            "temperature_1": torch.minimum(p, q).sum(-1).mean().item()}


def map_check(target: LoadedModel, draft: LoadedModel, agreement: float, seed: int, probes: torch.Tensor) -> dict:
    """The pair built at (`agreement`, `seed`) read on `probes`: the designed share of agreeing tokens, each
    model's map fidelity, and the per-token acceptance its distributions predict."""
    successor, draft_successor = successor_maps(target.model.get_output_embeddings().weight.shape[0], agreement, seed)
    return {"designed_greedy_agreement": (successor == draft_successor).float().mean().item(),
            "map_fidelity": {"target": map_fidelity(target, successor, probes),
                             "draft": map_fidelity(draft, draft_successor, probes)},
            "predicted_per_token_acceptance": predicted_acceptance(target, draft, probes)}


@dataclass
class TrialCountingStats(SpecDecodeStats):
    """The engine's counters, plus the drafted tokens verification judged: a draft of n tokens with k accepted judged
    min(k + 1, n), so accepted / judged is the per-token acceptance, exact even for drafts cut short near max_tokens."""

    num_judged_tokens: int = 0

    def observe(self, num_draft: int, num_accepted: int) -> None:
        super().observe(num_draft, num_accepted)
        self.num_judged_tokens += min(num_accepted + 1, num_draft)


def run_engine(target: LoadedModel, draft: LoadedModel, prompts: list[list[int]], draft_len: int, temperature: float,
               max_tokens: int, seed: int) -> tuple[dict[str, list[int]], TrialCountingStats]:
    """Every prompt through one co-located engine, all at once; returns the outputs and counters."""
    config = EngineConfig(max_model_len=max(map(len, prompts)) + max_tokens, max_num_seqs=len(prompts),
                          num_speculative_tokens=draft_len, max_draft_len=draft_len, prefill_chunk_tokens=64,
                          idle_prefill_tokens=128)
    engine = EngineCore.colocated(target, draft, config)
    engine.total_stats = TrialCountingStats()
    requests = {str(i): (p, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i,
                                           ignore_eos=True)) for i, p in enumerate(prompts)}
    return run_to_completion(engine, requests), engine.total_stats


def acceptance_counters(stats: TrialCountingStats) -> dict:
    """vLLM's spec-decode counters, plus the per-token acceptance (accepted / judged)."""
    return {**stats.to_dict(), "mean_acceptance_length": stats.mean_acceptance_length,
            "num_judged_tokens": stats.num_judged_tokens,
            "per_token_acceptance": stats.num_accepted_tokens / stats.num_judged_tokens}


def measure_acceptance(target: LoadedModel, draft: LoadedModel, num_prompts: int, draft_len: int,
                       max_tokens: int = 64, seed: int = 0) -> dict[str, dict]:
    """Acceptance counters of the engine decoding random prompts, greedy and at temperature 1.0."""
    prompts = random_prompts(num_prompts, target.model.get_output_embeddings().weight.shape[0], 4, 16, seed=seed)
    return {mode: acceptance_counters(run_engine(target, draft, prompts, draft_len, temperature, max_tokens, seed)[1])
            for mode, temperature in (("greedy", 0.0), ("temperature_1", 1.0))}


def evaluate(args: argparse.Namespace, agreement: float) -> dict:
    """Build one pair, check its map, and measure its acceptance through the engine."""
    target_config, draft_config = shape_configs(args.shape)
    target, draft = build_constructed_pair(target_config, draft_config, agreement, args.seed, args.dtype,
                                           args.device, args.sharpness, args.residual_scale)
    probes = probe_prompts(target_config["vocab_size"], PROBE_ROWS, seed=args.seed + 100)
    measured = measure_acceptance(target, draft, args.num_prompts, args.draft_len, args.max_tokens, args.seed)
    return {"agreement": agreement, **map_check(target, draft, agreement, args.seed, probes),
            "residual_share": {"target": residual_share(target, probes), "draft": residual_share(draft, probes)},
            "measured": measured}


def print_table(results: list[dict]) -> None:
    print(f"{'agreement':>9} {'fidelity t/d':>13} {'resid t/d':>11} | {'mode':<13} {'per-token':>9} "
          f"{'predicted':>9} {'accept_rate':>11} {'mean_len':>8}")
    for r in results:
        for mode, m in r["measured"].items():
            print(f"{r['agreement']:>9.2f} {r['map_fidelity']['target']:>6.3f}/{r['map_fidelity']['draft']:<6.3f} "
                  f"{r['residual_share']['target']:>5.2f}/{r['residual_share']['draft']:<5.2f} | {mode:<13} "
                  f"{m['per_token_acceptance']:>9.3f} {r['predicted_per_token_acceptance'][mode]:>9.3f} "
                  f"{m['acceptance_rate']:>11.3f} {m['mean_acceptance_length']:>8.3f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("small", "tinyllama-7b"), default="small")
    parser.add_argument("--agreement", type=float, nargs="+", default=[0.5, 0.8],
                        help="designed share of tokens whose draft successor equals the target's")
    parser.add_argument("--out", type=Path, required=True, help="directory for constructed_pair_<shape>.json")
    parser.add_argument("--sharpness", type=float, default=DEFAULT_SHARPNESS, help="the successor's logit")
    parser.add_argument("--residual-scale", type=float, default=DEFAULT_RESIDUAL_SCALE)
    parser.add_argument("--num-prompts", type=int, default=32, help="requests decoded together")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--draft-len", type=int, default=4, help="L, tokens drafted per verify step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda for tinyllama-7b, cpu for small")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 for tinyllama-7b, float32 for small")
    args = parser.parse_args(argv)
    full = args.shape != "small"
    args.device = args.device or ("cuda" if full else "cpu")
    args.dtype = args.dtype or ("bfloat16" if full else "float32")
    return args


def machine() -> dict:
    """Where the numbers came from. (lib/cluster.machine imports Ray, which the GPU image lacks.)"""
    return {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.machine()})",
            "cpu_cores": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load_average_1m": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    results = []
    for agreement in args.agreement:
        results.append(evaluate(args, agreement))
        # Runners and their CUDA graphs reference each other: free the last pair's memory before the next.
        gc.collect()
    print_table(results)
    target_config, draft_config = shape_configs(args.shape)
    report = {"command": " ".join(sys.argv), "machine": machine(), "wall_s": round(time.perf_counter() - start, 1),
              "args": {k: str(v) for k, v in vars(args).items()}, "target_config": target_config,
              "draft_config": draft_config, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"constructed_pair_{args.shape}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
