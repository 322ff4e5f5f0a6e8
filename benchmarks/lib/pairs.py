"""The constructed model pair on disk (docs/constructed_pair.md): built once, saved as two HF model
directories with a word-level tokenizer, reused by every later run, checked as the replicas load it."""

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from benchmarks.constructed_pair import build_constructed_pair, map_check, probe_prompts, shape_configs
from benchmarks.lib.cluster import free_device_memory, log
from lanes.model.loader import load_model

SAVED_MARK = "saved.json"  # written last into a saved model directory: the save finished
PAIR_DIR = Path("/tmp/vpd_gpu_modes")  # where the benchmarks keep saved pairs by default


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Token i is the word "t<i>"; no special tokens (the pairs have no EOS: requests end at max_tokens)."""
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class SavedPair:
    agreement: float
    target: Path
    draft: Path
    save_s: float  # building and saving; ~0 when both directories were already there
    check: dict  # check_reloaded (full) or check_stored_head per model (structure)


def save_pair(shape: str, agreement: float, pair_dir: Path, *, dtype: str, device: str, seed: int = 0,
              reload_check: str = "structure") -> SavedPair:
    """Build the pair on `device` and save it under `pair_dir`, unless a finished save is there (one target
    serves every agreement); then check it (`reload_check`: "full" or "structure")."""
    target_config, draft_config = shape_configs(shape)
    base = pair_dir / f"{shape}-seed{seed}-{dtype}"
    target_dir, draft_dir = base / "target", base / f"draft-agreement{agreement:g}"
    start = time.perf_counter()
    if not all((d / SAVED_MARK).exists() for d in (target_dir, draft_dir)):
        target, draft = build_constructed_pair(target_config, draft_config, agreement, seed, dtype, device)
        tokenizer = word_tokenizer(target_config["vocab_size"])
        for model, directory in ((target, target_dir), (draft, draft_dir)):
            if not (directory / SAVED_MARK).exists():
                model.model.save_pretrained(directory)
                tokenizer.save_pretrained(directory)
                (directory / SAVED_MARK).write_text(json.dumps({"agreement": agreement, "seed": seed}))
        del target, draft
        free_device_memory()
    save_s = time.perf_counter() - start
    log(f"pair a={agreement:g}: saved in {save_s:.1f} s under {base}")
    check = (check_reloaded(target_dir, draft_dir, agreement, seed, dtype, device) if reload_check == "full"
             else {role: check_stored_head(d) for role, d in (("target", target_dir), ("draft", draft_dir))})
    log(f"pair a={agreement:g}: checked ({reload_check}): {json.dumps(check)}")
    return SavedPair(agreement, target_dir, draft_dir, save_s, check)


@torch.inference_mode()
def check_reloaded(target_dir: Path, draft_dir: Path, agreement: float, seed: int, dtype: str, device: str) -> dict:
    """Load both directories as the replicas do and check the map survived: map fidelity, an
    untied LM head, and the greedy agreement on random contexts against the designed share."""
    start = time.perf_counter()
    target = load_model(str(target_dir), dtype, device)
    draft = load_model(str(draft_dir), dtype, device)
    check = map_check(target, draft, agreement, seed, probe_prompts(len(target.tokenizer), 8, seed=seed + 100))
    check["untied_lm_head"] = all(m.model.get_output_embeddings().weight.data_ptr()
                                  != m.model.get_input_embeddings().weight.data_ptr() for m in (target, draft))
    check["ok"] = (min(check["map_fidelity"].values()) >= 0.95 and check["untied_lm_head"] and
                   abs(check["predicted_per_token_acceptance"]["greedy"] - check["designed_greedy_agreement"]) <= 0.05)
    check["check_s"] = round(time.perf_counter() - start, 1)
    del target, draft
    free_device_memory()
    return check


def check_stored_head(model_dir: Path) -> dict:
    """The cheap check (no weights read): the LM head is stored apart from the embeddings and the
    config says untied, so from_pretrained cannot tie them back."""
    config = json.loads((model_dir / "config.json").read_text())
    stored = set()
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as tensors:
            stored.update(tensors.keys())
    check = {"tie_word_embeddings": config.get("tie_word_embeddings"), "lm_head_stored": "lm_head.weight" in stored,
             "embeddings_stored": "model.embed_tokens.weight" in stored}
    check["ok"] = check["tie_word_embeddings"] is False and check["lm_head_stored"] and check["embeddings_stored"]
    return check

