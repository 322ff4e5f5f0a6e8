"""Measure the shipped pair on held-out text with plain Hugging Face forward passes.

Reports, for the files the corpus split holds out (training/corpus.py):
- held-out cross-entropy per token of the target and of the draft;
- greedy speculative decoding from held-out prompts at each draft length L: acceptance per drafted
  token (accepted / drafted, vLLM's acceptance rate) and mean tokens per verify step (accepted + 1,
  vLLM's mean acceptance length);
- at temperature 1.0, alpha = E[sum_x min(p(x), q(x))] per position along target-sampled
  continuations (Leviathan et al. 2023), and what alpha implies for each L;
- optionally (--time-cpu) the CPU wall time of 64-token generation, and sample outputs.

Writes JSON (default models/pair_metrics.json) and prints a table.

Example:
    python -m training.measure_pair --models models --device cuda --time-cpu
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from training.corpus import collect_corpus, format_document
from training.speculative_reference import greedy_speculative_generate, rollout
from training.tokenizer import encode_documents

SAMPLE_PROMPTS = ("import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n")
CHAT_SAMPLE = [{"role": "user", "content": "Write the Python module json/tool.py."}]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=Path("models"), help="folder holding vpd-target and vpd-draft")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--site-packages", action="store_true", help="the corpus flag the pair was trained with")
    parser.add_argument("--heldout-fraction", type=float, default=0.03, help="must match training")
    parser.add_argument("--loss-tokens", type=int, default=262_144, help="held-out tokens scored for the loss")
    parser.add_argument("--seq-len", type=int, default=512, help="window for the held-out loss")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded after each prompt")
    parser.add_argument("--draft-lengths", type=int, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-cpu", action="store_true", help="also time 64-token generation on CPU")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default <models>/pair_metrics.json)")
    return parser.parse_args(argv)


def load_model(model_dir: Path, device: str) -> PreTrainedModel:
    # fp32 so that measurement does not depend on the device's bf16 kernels
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device).eval()


@torch.no_grad()
def heldout_loss_per_token(model: PreTrainedModel, stream: np.ndarray, seq_len: int, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping ``seq_len`` windows of ``stream``."""
    num_windows = len(stream) // seq_len
    assert num_windows > 0, "held-out stream shorter than one window"
    windows = torch.from_numpy(stream[: num_windows * seq_len].astype(np.int64)).view(num_windows, seq_len)
    total_nats, total_tokens = 0.0, 0
    for start in range(0, num_windows, batch_size):
        batch = windows[start : start + batch_size].to(model.device)  # [batch, seq_len]
        logits = model(input_ids=batch).logits[:, :-1].float()  # [batch, seq_len - 1, vocab]
        labels = batch[:, 1:]
        total_nats += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
        total_tokens += labels.numel()
    return total_nats / total_tokens


def heldout_prompts(stream: np.ndarray, num_prompts: int, prompt_tokens: int) -> torch.Tensor:
    """[num_prompts, prompt_tokens] windows spread evenly over the held-out stream."""
    starts = np.linspace(0, len(stream) - prompt_tokens - 1, num_prompts).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s : s + prompt_tokens] for s in starts]).astype(np.int64))


def draft_rollouts(draft: PreTrainedModel, prompts: torch.Tensor, reference: torch.Tensor, new_tokens: int, max_len: int):
    """The draft's greedy proposal of ``max_len`` tokens after every prefix of the target's
    continuation: [batch, new_tokens, max_len]. Equal-length prefixes batch without padding."""
    proposals = []
    for position in range(new_tokens):
        prefix = torch.cat([prompts, reference[:, :position]], dim=1)
        proposals.append(rollout(draft, prefix, max_len))
    return torch.stack(proposals, dim=1)


def simulate_greedy_rounds(accepted_at: np.ndarray, draft_len: int, new_tokens: int) -> list[int]:
    """Accepted counts of each round when decoding ``new_tokens`` tokens; ``accepted_at[i]`` is
    what a round starting at position i would accept. Each round advances by accepted + 1."""
    counts = []
    position = 0
    while position < new_tokens:
        accepted = int(accepted_at[position])
        counts.append(accepted)
        position += accepted + 1
    return counts


def greedy_rounds(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: torch.Tensor,
    new_tokens: int,
    draft_lengths: list[int],
) -> dict[int, list[int]]:
    """Accepted counts of every round of greedy speculative decoding, per draft length.

    Simulated exactly: with greedy verification the output is the target's greedy continuation,
    so a round's acceptance is how far the draft's greedy proposal agrees with it."""
    max_len = max(draft_lengths)
    reference = rollout(target, prompts, new_tokens + max_len)  # [batch, new_tokens + max_len]
    proposals = draft_rollouts(draft, prompts, reference, new_tokens, max_len)  # [batch, new_tokens, max_len]
    expected = reference.unfold(1, max_len, 1)[:, :new_tokens]  # [batch, new_tokens, max_len]
    agree_prefix = (proposals == expected).int().cumprod(dim=-1).cpu().numpy()  # [batch, new_tokens, max_len]
    rounds = {}
    for draft_len in draft_lengths:
        accepted_at = agree_prefix[:, :, :draft_len].sum(axis=-1)  # [batch, new_tokens]
        rounds[draft_len] = [c for row in accepted_at for c in simulate_greedy_rounds(row, draft_len, new_tokens)]
    return rounds


def summarize_rounds(accepted_counts: list[int], draft_len: int) -> dict:
    """The counters vLLM keeps for speculative decoding, and the two rates built from them."""
    drafts = len(accepted_counts)
    accepted = int(sum(accepted_counts))
    return {
        "num_drafts": drafts,
        "num_draft_tokens": drafts * draft_len,
        "num_accepted_tokens": accepted,
        "acceptance_per_drafted_token": round(accepted / (drafts * draft_len), 4),
        "mean_tokens_per_verify_step": round(1 + accepted / drafts, 4),
    }


@torch.no_grad()
def sampled_overlap(
    target: PreTrainedModel, draft: PreTrainedModel, prompts: torch.Tensor, new_tokens: int, generator: torch.Generator
) -> torch.Tensor:
    """sum_x min(p(x), q(x)) at each position of temperature-1 continuations sampled from the
    target: [batch, new_tokens]. Its mean is Leviathan et al.'s alpha."""
    continuation = rollout(target, prompts, new_tokens, generator=generator)
    sequence = torch.cat([prompts, continuation], dim=1)
    scored = slice(prompts.shape[1] - 1, -1)  # logits that predict the continuation
    p = torch.softmax(target(input_ids=sequence).logits[:, scored].float(), dim=-1)  # [batch, new, vocab]
    q = torch.softmax(draft(input_ids=sequence).logits[:, scored].float(), dim=-1)
    return torch.minimum(p, q).sum(dim=-1).cpu()


def implied_by_alpha(alpha: float, draft_len: int) -> dict:
    """Leviathan et al.: with i.i.d. acceptance alpha, E[accepted] = sum_{k=1..L} alpha^k."""
    expected_accepted = sum(alpha**k for k in range(1, draft_len + 1))
    return {
        "acceptance_per_drafted_token": round(expected_accepted / draft_len, 4),
        "mean_tokens_per_verify_step": round(1 + expected_accepted, 4),
    }


def in_batches(fn, prompts: torch.Tensor, batch_size: int) -> list:
    return [fn(prompts[start : start + batch_size]) for start in range(0, len(prompts), batch_size)]


def median_time_s(fn, repeats: int = 5) -> dict[str, float]:
    """Median wall time and median process CPU time of ``fn``. On a shared machine the wall time
    includes waiting for a core; the CPU time is what the work itself cost."""
    fn()  # warm-up: first calls allocate and pick kernels
    wall_s, cpu_s = [], []
    for _ in range(repeats):
        wall_started, cpu_started = time.perf_counter(), time.process_time()
        fn()
        wall_s.append(time.perf_counter() - wall_started)
        cpu_s.append(time.process_time() - cpu_started)
    return {"wall_s": round(float(np.median(wall_s)), 4), "cpu_s": round(float(np.median(cpu_s)), 4)}


def cpu_timing_and_samples(models_dir: Path, new_tokens: int) -> dict:
    """Wall time of ``new_tokens``-token greedy generation on CPU (fp32), and decoded samples."""
    tokenizer = AutoTokenizer.from_pretrained(models_dir / "vpd-target")
    target = load_model(models_dir / "vpd-target", "cpu")
    draft = load_model(models_dir / "vpd-draft", "cpu")
    prompt = tokenizer(SAMPLE_PROMPTS[0], return_tensors="pt").input_ids
    timing = {
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "new_tokens": new_tokens,
        "target_generate": median_time_s(
            lambda: target.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        ),
        "speculative_L4": median_time_s(lambda: greedy_speculative_generate(target, draft, prompt, new_tokens, 4)),
    }
    chat_text = tokenizer.apply_chat_template(CHAT_SAMPLE, add_generation_prompt=True, tokenize=False)
    samples = {}
    for name, text in [("plain_0", SAMPLE_PROMPTS[0]), ("plain_1", SAMPLE_PROMPTS[1]), ("chat", chat_text)]:
        ids = tokenizer(text, return_tensors="pt").input_ids
        new_ids, _ = greedy_speculative_generate(target, draft, ids, new_tokens, 4)
        samples[name] = text + tokenizer.decode(new_ids[0])
    return {"cpu_timing": timing, "samples": samples}


def print_table(metrics: dict) -> None:
    print(f"held-out loss (nats/token): target {metrics['heldout_loss']['target']:.4f}, "
          f"draft {metrics['heldout_loss']['draft']:.4f}")
    print(f"{'L':>3} {'greedy acc/drafted':>19} {'greedy tok/step':>16} {'T=1 acc (alpha)':>16} {'T=1 tok/step':>13}")
    for draft_len, greedy in metrics["greedy"].items():
        sampled = metrics["temperature_1"]["implied"][draft_len]
        print(f"{draft_len:>3} {greedy['acceptance_per_drafted_token']:>19.4f} "
              f"{greedy['mean_tokens_per_verify_step']:>16.4f} {sampled['acceptance_per_drafted_token']:>16.4f} "
              f"{sampled['mean_tokens_per_verify_step']:>13.4f}")
    print(f"alpha (T=1): {metrics['temperature_1']['alpha']:.4f}")
    if "cpu_timing" in metrics:
        print(f"CPU timing: {json.dumps(metrics['cpu_timing'])}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.models / "vpd-target")
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(args.models / "vpd-draft").get_vocab()
    corpus = collect_corpus(args.site_packages, args.heldout_fraction)
    stream = encode_documents(tokenizer, [format_document(f) for f in corpus.heldout])
    target = load_model(args.models / "vpd-target", args.device)
    draft = load_model(args.models / "vpd-draft", args.device)

    loss_stream = stream[: args.loss_tokens]
    prompts = heldout_prompts(stream, args.num_prompts, args.prompt_tokens).to(args.device)
    rounds: dict[int, list[int]] = {n: [] for n in args.draft_lengths}
    for part in in_batches(
        lambda b: greedy_rounds(target, draft, b, args.new_tokens, args.draft_lengths), prompts, args.batch_size
    ):
        for draft_len, counts in part.items():
            rounds[draft_len].extend(counts)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    overlaps = in_batches(
        lambda b: sampled_overlap(target, draft, b, args.new_tokens, generator), prompts, args.batch_size
    )
    alpha = torch.cat(overlaps).mean().item()
    metrics = {
        "corpus": corpus.manifest,
        "heldout_tokens_scored": int(len(loss_stream)),
        "heldout_loss": {
            "target": round(heldout_loss_per_token(target, loss_stream, args.seq_len, args.batch_size), 4),
            "draft": round(heldout_loss_per_token(draft, loss_stream, args.seq_len, args.batch_size), 4),
        },
        "decoding": {"num_prompts": args.num_prompts, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens},
        "greedy": {str(n): summarize_rounds(rounds[n], n) for n in args.draft_lengths},
        "temperature_1": {
            "alpha": round(alpha, 4),
            "implied": {str(n): implied_by_alpha(alpha, n) for n in args.draft_lengths},
        },
        "device": args.device,
    }
    if args.time_cpu:
        metrics.update(cpu_timing_and_samples(args.models, args.new_tokens))
    out_path = args.out or args.models / "pair_metrics.json"
    out_path.write_text(json.dumps(metrics, indent=2) + "\n")
    print_table(metrics)


if __name__ == "__main__":
    main()
