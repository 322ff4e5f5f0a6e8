"""Train the default target/draft pair that ships in ``models/``.

Steps: collect the Python-source corpus (training/corpus.py), train a byte-level BPE tokenizer on
its standard-library part, train the target (Llama, ~8 M parameters) with next-token
cross-entropy, then distill the draft (Llama, ~1.7 M parameters) from the target's logits. Budgets
are in optimizer steps and every random choice comes from ``--seed``, so a rerun on the same
corpus and hardware gives the same weights. Writes ``<out>/vpd-target``, ``<out>/vpd-draft``
(bf16 safetensors, tokenizer, chat template, generation config) and
``<out>/training_summary.json``.

Example (the command that made the shipped pair is in models/README.md):
    python -m training.train_pair --device cuda --site-packages --out models
"""

import argparse
import contextlib
import json
import math
import os
import platform
import random
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from training.corpus import Corpus, collect_corpus, format_document
from training.measure_pair import heldout_loss_per_token
from training.tokenizer import encode_documents, train_bpe

TARGET_DIR_NAME = "vpd-target"
DRAFT_DIR_NAME = "vpd-draft"
MAX_POSITION_EMBEDDINGS = 2048


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("models"), help="folder for the two model folders")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--site-packages", action="store_true", help="add installed packages' source to the corpus")
    parser.add_argument("--heldout-fraction", type=float, default=0.03)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512, help="training context in tokens")
    parser.add_argument("--batch-size", type=int, default=128, help="sequences per optimizer step")
    parser.add_argument("--target-steps", type=int, default=4000)
    parser.add_argument("--draft-steps", type=int, default=4000)
    parser.add_argument("--target-lr", type=float, default=2e-3)
    parser.add_argument("--draft-lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--distill-temperature", type=float, default=1.0)
    parser.add_argument(
        "--distill-ce-weight", type=float, default=0.0,
        help="weight of the data cross-entropy in the draft's loss (the rest is KL to the target)",
    )
    parser.add_argument("--eval-every", type=int, default=500, help="steps between held-out evaluations")
    parser.add_argument("--eval-tokens", type=int, default=262_144, help="held-out tokens per evaluation")
    parser.add_argument(
        "--allow-nondeterministic", action="store_true",
        help="on CUDA, only warn where an op has no deterministic kernel (reruns may then differ)",
    )
    parser.add_argument("--tiny", action="store_true", help="shrink both models (smoke tests only)")
    return parser.parse_args(argv)


def target_config(vocab_size: int, tiny: bool) -> LlamaConfig:
    """~7.9 M parameters at vocab 4096: 8 layers of width 256, tied embeddings."""
    hidden, layers, heads, ffn = (64, 2, 2, 128) if tiny else (256, 8, 8, 768)
    return llama_config(vocab_size, hidden, layers, heads, ffn)


def draft_config(vocab_size: int, tiny: bool) -> LlamaConfig:
    """~1.7 M parameters at vocab 4096: 2 layers of width 192 (two layers are the fewest that can
    copy earlier text, which much of code is)."""
    hidden, layers, heads, ffn = (32, 1, 1, 64) if tiny else (192, 2, 6, 512)
    return llama_config(vocab_size, hidden, layers, heads, ffn)


def llama_config(vocab_size: int, hidden: int, layers: int, heads: int, ffn: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=True,  # the embedding is most of a small model's parameters
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def seed_everything(seed: int, device: str, allow_nondeterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.startswith("cuda"):
        # cuBLAS needs this before its first call to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        # Strict mode also switches attention backward (flash / cuDNN) to its deterministic
        # kernels; with warn_only they stay non-deterministic and a rerun drifts.
        torch.use_deterministic_algorithms(True, warn_only=allow_nondeterministic)


class TokenWindows:
    """Random fixed-length windows of one token stream, drawn with a seeded generator."""

    def __init__(self, stream: np.ndarray, seq_len: int, device: str, seed: int):
        assert len(stream) > seq_len + 1, "corpus shorter than one window"
        self.tokens = torch.from_numpy(stream.astype(np.int64)).to(device)  # [num_tokens]
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(seq_len + 1, device=device)  # [seq_len + 1]

    def sample(self, batch_size: int) -> torch.Tensor:
        """[batch, seq_len + 1]: inputs are [:, :-1], next-token labels are [:, 1:]."""
        high = len(self.tokens) - self.seq_len - 1
        starts = torch.randint(high, (batch_size,), generator=self.generator).to(self.tokens.device)
        return self.tokens[starts[:, None] + self.offsets]


def autocast(device: str) -> contextlib.AbstractContextManager:
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()  # CPU runs are smoke tests; fp32 keeps them simple


def cosine_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int):
    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # Norm gains are not decayed: pulling them to zero only fights the normalization.
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    kept = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def next_token_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits  # [batch, seq, vocab]
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def distillation_loss(
    draft: LlamaForCausalLM, target: LlamaForCausalLM, batch: torch.Tensor, temperature: float, ce_weight: float
) -> torch.Tensor:
    """KL(target || draft) on temperature-softened distributions, optionally mixed with data CE."""
    inputs = batch[:, :-1]
    with torch.no_grad():
        teacher_logits = target(input_ids=inputs).logits.flatten(0, 1).float()  # [tokens, vocab]
    student_logits = draft(input_ids=inputs).logits.flatten(0, 1).float()  # [tokens, vocab]
    teacher_logp = F.log_softmax(teacher_logits / temperature, dim=-1)
    student_logp = F.log_softmax(student_logits / temperature, dim=-1)
    # T^2 keeps the gradient scale independent of the temperature (Hinton et al. 2015).
    kl = F.kl_div(student_logp, teacher_logp, log_target=True, reduction="batchmean") * temperature**2
    if ce_weight == 0.0:
        return kl
    ce = F.cross_entropy(student_logits, batch[:, 1:].flatten())
    return (1 - ce_weight) * kl + ce_weight * ce


def run_steps(
    name: str,
    model: LlamaForCausalLM,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    windows: TokenWindows,
    heldout: np.ndarray,
    args: argparse.Namespace,
    lr: float,
    total_steps: int,
) -> dict:
    """The shared optimizer loop; returns a log of training and held-out losses."""
    model.train()
    optimizer = make_optimizer(model, lr, args.weight_decay)
    scheduler = cosine_schedule(optimizer, args.warmup_steps, total_steps)
    history = []
    started_s = time.perf_counter()
    for step in range(1, total_steps + 1):
        with autocast(args.device):
            loss = loss_fn(windows.sample(args.batch_size))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % args.eval_every == 0 or step == total_steps:
            record = evaluate(model, heldout, args)
            record.update(step=step, train_loss=loss.item(), elapsed_s=time.perf_counter() - started_s)
            history.append(record)
            print(f"[{name}] {json.dumps(record)}", flush=True)
            model.train()
    return {"steps": total_steps, "tokens_seen": total_steps * args.batch_size * args.seq_len, "history": history}


def evaluate(model: LlamaForCausalLM, heldout: np.ndarray, args: argparse.Namespace) -> dict:
    model.eval()
    with autocast(args.device):
        loss = heldout_loss_per_token(model, heldout[: args.eval_tokens], args.seq_len, args.batch_size)
    return {"heldout_loss": round(loss, 4)}


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are listed once


def save_model(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """bf16 safetensors + tokenizer + generation config that stops at either end token."""
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def build_streams(corpus: Corpus, tokenizer: PreTrainedTokenizerFast) -> tuple[np.ndarray, np.ndarray]:
    train = encode_documents(tokenizer, [format_document(f) for f in corpus.train])
    heldout = encode_documents(tokenizer, [format_document(f) for f in corpus.heldout])
    return train, heldout


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    seed_everything(args.seed, args.device, args.allow_nondeterministic)
    started_s = time.perf_counter()
    corpus = collect_corpus(args.site_packages, args.heldout_fraction)
    print(f"corpus: {json.dumps(corpus.manifest)}", flush=True)
    # The tokenizer sees only the standard library, so it is the same whatever else is installed.
    tokenizer = train_bpe((f.text for f in corpus.train if f.root_name == "stdlib"), args.vocab_size)
    train_stream, heldout_stream = build_streams(corpus, tokenizer)
    elapsed_s = time.perf_counter() - started_s
    print(f"tokens: train {len(train_stream)}, held-out {len(heldout_stream)} ({elapsed_s:.0f} s)", flush=True)
    windows = TokenWindows(train_stream, args.seq_len, args.device, args.seed)

    target = LlamaForCausalLM(target_config(len(tokenizer), args.tiny)).to(args.device)
    print(f"target parameters: {count_parameters(target)}", flush=True)
    target_loss = partial(next_token_loss, target)
    target_log = run_steps(
        "target", target, target_loss, windows, heldout_stream, args, args.target_lr, args.target_steps
    )
    target.eval().requires_grad_(False)

    draft = LlamaForCausalLM(draft_config(len(tokenizer), args.tiny)).to(args.device)
    print(f"draft parameters: {count_parameters(draft)}", flush=True)
    draft_loss = partial(
        distillation_loss, draft, target, temperature=args.distill_temperature, ce_weight=args.distill_ce_weight
    )
    draft_log = run_steps("draft", draft, draft_loss, windows, heldout_stream, args, args.draft_lr, args.draft_steps)

    summary = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "corpus": corpus.manifest,
        "train_tokens": len(train_stream),
        "heldout_tokens": len(heldout_stream),
        "target": {"parameters": count_parameters(target), **target_log},
        "draft": {"parameters": count_parameters(draft), **draft_log},
        "wall_s": round(time.perf_counter() - started_s, 1),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    save_model(target, tokenizer, args.out / TARGET_DIR_NAME)
    save_model(draft, tokenizer, args.out / DRAFT_DIR_NAME)
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved to {args.out} after {summary['wall_s']} s", flush=True)


if __name__ == "__main__":
    main()
