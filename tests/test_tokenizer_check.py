"""Pairing a draft with a target: a tokenizer that differs in any way is refused by default; with
`allow_tokenizer_mismatch` only ids that name different token strings are (issue 16, item 5).

The tokenizers are the shipped target's real BPE tokenizer and variants of its tokenizer.json with
one thing changed: its merges, a special token, or the strings of two ids."""

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from deployments.config import AppConfig
from lanes.model.loader import (IncompatibleModelsError, LoadedModel, build_random_model, check_compatible,
                                tokenizer_differences)

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "vpd-target"


@pytest.fixture(scope="module")
def base():
    return AutoTokenizer.from_pretrained(SHIPPED)


@pytest.fixture(scope="module")
def model():
    # One small random model stands for both: only the tokenizers differ between the pairs below.
    return build_random_model({"model_type": "llama", "vocab_size": 4096, "hidden_size": 16, "intermediate_size": 32,
                               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1})


def _variant(edit, tmp_path_factory) -> PreTrainedTokenizerBase:
    """The shipped tokenizer with `edit` applied to its tokenizer.json, loaded as a user's would be."""
    folder = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED / name, folder / name)
    definition = json.loads((folder / "tokenizer.json").read_text())
    edit(definition)
    (folder / "tokenizer.json").write_text(json.dumps(definition))
    return AutoTokenizer.from_pretrained(folder)


def _drop_last_merges(definition: dict) -> None:
    definition["model"]["merges"] = definition["model"]["merges"][:-50]


def _swap_two_ids(definition: dict) -> None:
    vocab = definition["model"]["vocab"]
    a, b = "def", "class"
    vocab[a], vocab[b] = vocab[b], vocab[a]


def _pair(model, draft_tokenizer, target_tokenizer):
    return LoadedModel(model.model, draft_tokenizer, "draft"), LoadedModel(model.model, target_tokenizer, "target")


def test_the_same_tokenizer_pairs(base, model, tmp_path_factory):
    same = _variant(lambda d: None, tmp_path_factory)
    assert tokenizer_differences(same, base) == []
    check_compatible(*_pair(model, same, base))


def test_other_merges_are_refused_by_default_and_paired_on_token_strings(base, model, tmp_path_factory):
    other = _variant(_drop_last_merges, tmp_path_factory)
    assert other.get_vocab() == base.get_vocab()  # equal vocabularies: an id check alone would pass them
    assert tokenizer_differences(other, base) == ["merges"]
    with pytest.raises(IncompatibleModelsError, match="differ in merges.*allow_tokenizer_mismatch"):
        check_compatible(*_pair(model, other, base))
    check_compatible(*_pair(model, other, base), allow_tokenizer_mismatch=True)


def test_another_special_token_is_refused(base, model, tmp_path_factory):
    other = _variant(lambda d: None, tmp_path_factory)
    other.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    assert "special tokens" in tokenizer_differences(other, base)
    with pytest.raises(IncompatibleModelsError, match="special tokens"):
        check_compatible(*_pair(model, other, base))
    # The ids both define still name the same strings: a user may insist.
    check_compatible(*_pair(model, other, base), allow_tokenizer_mismatch=True)


def test_ids_that_name_other_strings_are_refused_even_when_allowed(base, model, tmp_path_factory):
    other = _variant(_swap_two_ids, tmp_path_factory)
    with pytest.raises(IncompatibleModelsError, match="differ in vocabulary"):
        check_compatible(*_pair(model, other, base))
    with pytest.raises(IncompatibleModelsError, match=r"2 token ids name different strings.*'def' vs 'class'"):
        check_compatible(*_pair(model, other, base), allow_tokenizer_mismatch=True)


def test_the_config_field_reaches_the_draft():
    cfg = AppConfig.model_validate({"mode": "spec", "draft": {"path": "models/vpd-draft",
                                                              "allow_tokenizer_mismatch": True}})
    assert cfg.draft_model.allow_tokenizer_mismatch
    assert not AppConfig.model_validate({"mode": "spec"}).draft_model.allow_tokenizer_mismatch
