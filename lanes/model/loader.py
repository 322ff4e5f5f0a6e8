"""Loading the draft and target models, and checking that they can speculate together."""

import json
from dataclasses import dataclass

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig,
                          PreTrainedTokenizerBase)

from lanes.model.families import check_supported

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class IncompatibleModelsError(ValueError):
    """Draft and target cannot be paired: speculation needs one shared vocabulary."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase | None
    name: str


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_model(name_or_path: str, dtype: str | torch.dtype = "float32", device: str = "cpu",
               max_positions: int | None = None) -> LoadedModel:
    """Load an HF causal LM the engine runs exactly (lanes/model/families.py decides, from the config,
    before any weight is read) and its tokenizer, by hub id or local path. `max_positions`: the KV
    slot capacity it will serve with."""
    config = AutoConfig.from_pretrained(name_or_path)
    check_supported(config, max_positions)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, config=config, dtype=resolve_dtype(dtype))
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    return LoadedModel(_prepare(model, device), tokenizer, name_or_path)


@dataclass
class Vocabulary:
    """What an engine that holds no model needs of one: ids, their text, and when to stop."""

    size: int  # output logits of the model
    tokenizer: PreTrainedTokenizerBase
    generation_config: GenerationConfig | None


def load_vocabulary(name_or_path: str) -> Vocabulary:
    """The vocabulary of a model, without its weights (a decode lane that drafts by prompt lookup)."""
    try:
        generation = GenerationConfig.from_pretrained(name_or_path)
    except OSError:  # no generation_config.json: the model config's own EOS applies
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(name_or_path))
    return Vocabulary(AutoConfig.from_pretrained(name_or_path).get_text_config().vocab_size,
                      AutoTokenizer.from_pretrained(name_or_path), generation)


def build_random_model(
    config: PretrainedConfig | dict, dtype: str | torch.dtype = "float32", device: str = "cpu", seed: int = 0
) -> LoadedModel:
    """A model with random weights built from a config (tests, shape-faithful benchmarks)."""
    if isinstance(config, dict):
        config = AutoConfig.for_model(**config)
    check_supported(config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype))
    return LoadedModel(_prepare(model, device), None, f"random-{config.model_type}")


def _prepare(model: torch.nn.Module, device: str) -> torch.nn.Module:
    # sdpa takes our additive 4D mask as-is and is the fast path on both CPU and GPU.
    model.config._attn_implementation = "sdpa"
    return model.to(device).eval().requires_grad_(False)


def check_compatible(draft: LoadedModel, target: LoadedModel, allow_tokenizer_mismatch: bool = False) -> None:
    """Refuse a pair whose token ids do not mean the same thing.

    By default the two tokenizers must be the same tokenizer: vocabulary, merges, special and added
    tokens, normalizer and pre-tokenizer. A draft trained with other merges still proposes valid ids,
    but they are ids of text split differently from the target's, and acceptance collapses; a
    different special token makes an id mean another thing. `allow_tokenizer_mismatch` relaxes this
    to what speculation needs: every id that both tokenizers define names the same token string.
    """
    draft_vocab = draft.model.get_output_embeddings().weight.shape[0]
    target_vocab = target.model.get_output_embeddings().weight.shape[0]
    if draft_vocab != target_vocab:
        raise IncompatibleModelsError(
            f"draft {draft.name!r} has {draft_vocab} output logits, target {target.name!r} has {target_vocab}"
        )
    if draft.tokenizer is None or target.tokenizer is None:
        return  # random models built from configs share ids by construction
    if allow_tokenizer_mismatch:
        _check_token_strings(draft, target)
    else:
        differences = tokenizer_differences(draft.tokenizer, target.tokenizer)
        if differences:
            raise IncompatibleModelsError(
                f"tokenizers of draft {draft.name!r} and target {target.name!r} differ in {', '.join(differences)} "
                "(set the draft's allow_tokenizer_mismatch: true to pair them where every id names the same "
                "token string)")
    if draft.tokenizer.eos_token_id != target.tokenizer.eos_token_id:
        raise IncompatibleModelsError("draft and target tokenizers disagree on the EOS token")


# Parts of a fast tokenizer's definition (its tokenizer.json) that decide how text becomes ids.
_TOKENIZER_PARTS = ("normalizer", "pre_tokenizer", "model")


def tokenizer_differences(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> list[str]:
    """What differs between two tokenizers, by name (empty: the same tokenizer)."""
    differences = []
    if a.get_vocab() != b.get_vocab():
        differences.append("vocabulary")
    if _added_tokens(a) != _added_tokens(b) or a.all_special_tokens != b.all_special_tokens:
        differences.append("special tokens")
    spec_a, spec_b = _definition(a), _definition(b)
    for part in _TOKENIZER_PARTS:
        if spec_a.get(part) == spec_b.get(part):
            continue
        if part != "model":
            differences.append(part)
        elif "vocabulary" not in differences:  # the model holds the vocabulary too; else its merges differ
            differences.append("merges")
    return differences


def _added_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[int, tuple[str, bool]]:
    return {i: (t.content, t.special) for i, t in tokenizer.added_tokens_decoder.items()}


def _definition(tokenizer: PreTrainedTokenizerBase) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return json.loads(backend.to_str()) if backend is not None else {}


def _check_token_strings(draft: LoadedModel, target: LoadedModel) -> None:
    """Every id that both tokenizers define names the same token string."""
    ids = list(range(min(len(draft.tokenizer), len(target.tokenizer))))
    draft_tokens = draft.tokenizer.convert_ids_to_tokens(ids)
    target_tokens = target.tokenizer.convert_ids_to_tokens(ids)
    differ = [i for i, d, t in zip(ids, draft_tokens, target_tokens) if d != t]
    if differ:
        shown = ", ".join(f"{i}: {draft_tokens[i]!r} vs {target_tokens[i]!r}" for i in differ[:5])
        raise IncompatibleModelsError(
            f"{len(differ)} token ids name different strings in draft {draft.name!r} and target "
            f"{target.name!r} (e.g. {shown}): they cannot speculate together")
