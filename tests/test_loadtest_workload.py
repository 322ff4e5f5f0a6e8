"""Workloads: ShareGPT filtering, seeded synthetic lengths, the long-prompt share, arrivals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from loadtest.arrivals import ClosedLoop, OpenLoop
from loadtest.workload import (LengthFilter, LogNormal, count_tokens, fit_lognormal,
                               load_sharegpt, load_tokenizer, mix_long_prompts, synthetic)

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A real byte-level BPE tokenizer saved and loaded the way the shipped one is; trained so
    that each of WORDS after a space is one token, which makes lengths known by construction."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(["".join(" " + w for w in WORDS)] * 50, trainer=trainer)
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(
        directory)
    return load_tokenizer(directory)


def _text(num_words: int, offset: int = 0) -> str:
    # A leading space makes every word the same single " word" token.
    return "".join(" " + WORDS[(offset + i) % len(WORDS)] for i in range(num_words))


def _conversation(prompt_words: int, reply_words: int | None, tag: int) -> dict:
    turns = [{"from": "human", "value": _text(prompt_words, tag)}]
    if reply_words is not None:
        turns.append({"from": "gpt", "value": _text(reply_words, tag + 1)})
    return {"id": f"c{tag}", "conversations": turns}


FILTER = LengthFilter(min_prompt_len=4, max_prompt_len=64, min_output_len=4, max_total_len=100)


@pytest.fixture
def sharegpt_file(tmp_path, tokenizer):
    kept = [_conversation(8 + i, 6 + i, tag=i) for i in range(6)]
    dropped = [_conversation(2, 10, tag=10),  # prompt under 4 tokens
               _conversation(10, 3, tag=11),  # output under 4 tokens
               _conversation(80, 10, tag=12),  # prompt over 64
               _conversation(50, 60, tag=13),  # prompt + output over 100
               _conversation(10, None, tag=14)]  # no reply
    assert count_tokens(tokenizer, _text(80)) == 80  # one token a word, as the cases assume
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(kept + dropped))
    return path, {c["conversations"][0]["value"] for c in kept}


def test_sharegpt_keeps_exactly_the_conversations_passing_the_length_filter(sharegpt_file,
                                                                            tokenizer):
    path, kept_prompts = sharegpt_file
    requests = load_sharegpt(path, tokenizer, num_requests=6, seed=0, length_filter=FILTER)
    assert {r.prompt for r in requests} == kept_prompts
    for r in requests:
        assert r.prompt_len == len(r.prompt.split())  # counted by the tokenizer: a word a token
        assert r.output_len == r.prompt_len - 2  # the reply's length (2 words shorter)


def test_sharegpt_fails_when_too_few_conversations_pass(sharegpt_file, tokenizer):
    path, _ = sharegpt_file
    with pytest.raises(ValueError, match="only 6"):
        load_sharegpt(path, tokenizer, num_requests=7, seed=0, length_filter=FILTER)


def test_sharegpt_order_follows_the_seed_and_output_len_can_be_fixed(sharegpt_file, tokenizer):
    path, _ = sharegpt_file
    orders = {seed: [r.prompt for r in load_sharegpt(path, tokenizer, 6, seed, FILTER)]
              for seed in range(4)}
    assert orders[0] == [r.prompt for r in load_sharegpt(path, tokenizer, 6, 0, FILTER)]
    assert len({tuple(o) for o in orders.values()}) > 1
    fixed = load_sharegpt(path, tokenizer, 6, 0, FILTER, output_len=32)
    assert [r.output_len for r in fixed] == [32] * 6


def test_synthetic_is_repeatable_from_its_seed(tokenizer):
    first = synthetic(tokenizer, 50, seed=3)
    assert first == synthetic(tokenizer, 50, seed=3)
    assert first != synthetic(tokenizer, 50, seed=4)


def test_synthetic_lengths_follow_the_clipped_lognormal(tokenizer):
    prompts = LogNormal(median=60, sigma=0.6, min_len=8, max_len=200)
    outputs = LogNormal(median=30, sigma=0.5, min_len=4, max_len=100)
    requests = synthetic(tokenizer, 400, seed=0, prompt_lengths=prompts, output_lengths=outputs)
    output_lens = np.array([r.output_len for r in requests])
    assert output_lens.min() >= 4 and output_lens.max() <= 100
    assert np.median(output_lens) == pytest.approx(30, rel=0.15)
    # The recorded prompt length is the tokenizer's count of the text actually sent.
    assert all(r.prompt_len == count_tokens(tokenizer, r.prompt) for r in requests)
    assert np.median([r.prompt_len for r in requests]) == pytest.approx(60, rel=0.15)


def test_lognormal_fit_recovers_its_parameters():
    truth = LogNormal(median=100, sigma=0.7, min_len=1, max_len=10**7)
    fitted = fit_lognormal(truth.sample(20000, np.random.default_rng(0)), 1, 10**7)
    assert fitted.median == pytest.approx(100, rel=0.03)
    assert fitted.sigma == pytest.approx(0.7, rel=0.03)


def test_long_prompt_share_is_exact_seeded_and_keeps_output_lengths(tokenizer):
    base = synthetic(tokenizer, 40, seed=1, prompt_lengths=LogNormal(20, 0.3, 4, 64))
    mixed = mix_long_prompts(base, share=0.25, long_prompt_len=300, tokenizer=tokenizer, seed=1)
    long_ones = [i for i, r in enumerate(mixed) if r.kind == "long"]
    assert len(long_ones) == 10
    assert mixed == mix_long_prompts(base, 0.25, 300, tokenizer, seed=1)
    assert [r.output_len for r in mixed] == [r.output_len for r in base]
    assert all(mixed[i] == base[i] for i in range(40) if i not in long_ones)
    assert all(abs(mixed[i].prompt_len - 300) <= 3 for i in long_ones)
    with pytest.raises(ValueError):
        mix_long_prompts(base, share=1.5, long_prompt_len=300, tokenizer=tokenizer, seed=1)


def test_missing_tokenizer_is_an_error_not_a_whitespace_count(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        load_tokenizer(tmp_path / "absent")


def _gaps(arrivals: OpenLoop, n: int) -> np.ndarray:
    source = arrivals.gaps_s(np.random.default_rng(0))
    return np.array([next(source) for _ in range(n)])


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_gaps_have_the_rate_and_burstiness_asked_for(burstiness):
    gaps = _gaps(OpenLoop(rate_rps=10.0, burstiness=burstiness), 40000)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    # A gamma of shape k has coefficient of variation 1 / sqrt(k); Poisson (k = 1) has 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_at_once_and_bad_loads_are_rejected():
    assert _gaps(OpenLoop(math.inf), 5).tolist() == [0.0] * 5
    with pytest.raises(ValueError):
        OpenLoop(rate_rps=0)
    with pytest.raises(ValueError):
        ClosedLoop(concurrency=0)
