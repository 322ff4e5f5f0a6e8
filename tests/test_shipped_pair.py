"""The default pair shipped in models/ loads offline with plain ``from_pretrained`` and behaves as
its model card says: one tokenizer, a target that is the better model, and greedy speculative
decoding (plain Hugging Face reference loop) that reproduces the target's own greedy output."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.speculative_reference import greedy_speculative_generate

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
TARGET_DIR = MODELS_DIR / "vpd-target"
DRAFT_DIR = MODELS_DIR / "vpd-draft"
MAX_PAIR_BYTES = 25_000_000

# Written for this test, so it is in no training corpus.
SNIPPET = '''import json
from pathlib import Path


class Inventory:
    """Counts of items, saved to and loaded from a JSON file."""

    def __init__(self, path):
        self.path = Path(path)
        self.counts = {}

    def add(self, name, amount=1):
        if amount <= 0:
            raise ValueError("amount must be positive")
        self.counts[name] = self.counts.get(name, 0) + amount

    def remove(self, name, amount=1):
        left = self.counts.get(name, 0) - amount
        if left < 0:
            raise KeyError(name)
        if left == 0:
            del self.counts[name]
        else:
            self.counts[name] = left

    def save(self):
        with open(self.path, "w", encoding="utf-8") as handle:
            json.dump(self.counts, handle, indent=2, sort_keys=True)

    def load(self):
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as handle:
            self.counts = json.load(handle)
'''
PROMPTS = ("def parse_args(argv=None):\n", "class LRUCache:\n    def __init__(self, capacity):\n")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET_DIR)


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft():
    return AutoModelForCausalLM.from_pretrained(DRAFT_DIR, dtype=torch.float32).eval()


def test_pair_fits_the_size_budget():
    total_bytes = sum(f.stat().st_size for d in (TARGET_DIR, DRAFT_DIR) for f in d.iterdir())
    assert total_bytes <= MAX_PAIR_BYTES


def test_tokenizers_are_identical(tokenizer):
    draft_tokenizer = AutoTokenizer.from_pretrained(DRAFT_DIR)
    assert tokenizer.get_vocab() == draft_tokenizer.get_vocab()
    assert tokenizer.all_special_tokens == draft_tokenizer.all_special_tokens
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (draft_tokenizer.eos_token_id, draft_tokenizer.pad_token_id)
    assert tokenizer.chat_template == draft_tokenizer.chat_template
    assert tokenizer(SNIPPET).input_ids == draft_tokenizer(SNIPPET).input_ids
    assert tokenizer.decode(tokenizer(SNIPPET).input_ids) == SNIPPET


def test_generation_config_stops_at_either_end_token(tokenizer, target, draft):
    end_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    for model in (target, draft):
        assert set(model.generation_config.eos_token_id) == end_ids
        assert model.config.max_position_embeddings >= 2048


def mean_loss_nats(model, input_ids: torch.Tensor) -> float:
    with torch.no_grad():
        return model(input_ids=input_ids, labels=input_ids).loss.item()


def test_target_is_the_better_model(tokenizer, target, draft):
    input_ids = tokenizer(SNIPPET, return_tensors="pt").input_ids
    target_loss = mean_loss_nats(target, input_ids)
    draft_loss = mean_loss_nats(draft, input_ids)
    # ln(4096) = 8.3 nats is what an untrained model scores.
    assert target_loss < draft_loss < 4.0


@pytest.mark.parametrize("num_draft_tokens", [2, 4])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_target_greedy(tokenizer, target, draft, prompt, num_draft_tokens):
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    new_tokens = 48
    expected = target.generate(input_ids, max_new_tokens=new_tokens, do_sample=False)[:, input_ids.shape[1] :]
    speculative, accepted = greedy_speculative_generate(target, draft, input_ids, new_tokens, num_draft_tokens)
    # generate() stops at an end token; the reference loop decodes on, so compare what both made.
    assert torch.equal(speculative[:, : expected.shape[1]], expected)
    assert sum(accepted) > 0, "a trained draft agrees with its target at least sometimes"


def test_greedy_output_reads_as_python(tokenizer, target):
    input_ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    output = target.generate(input_ids, max_new_tokens=64, do_sample=False)
    text = tokenizer.decode(output[0], skip_special_tokens=True)
    body_lines = text.splitlines()[1:]
    assert body_lines and all(not line or line.startswith("    ") for line in body_lines[:3])
    assert any(keyword in text for keyword in ("return", "import", " = "))
