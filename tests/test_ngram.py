"""Drafting by n-gram prompt lookup: the proposer on constructed sequences, greedy equality of the
engine with the target's own greedy decoding, the config that selects it, and the lanes it builds."""

import random

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from deployments.config import REPO_ROOT, AppConfig, NgramSpec
from deployments.factories import build_engine, build_prompt_prefiller
from lanes.engine.core import EngineConfig, EngineCore
from lanes.engine.sequence import Sequence
from lanes.sample.params import SamplingParams
from lanes.spec.ngram import NgramProposer
from lanes.spec.prompt_prefiller import PrefillRequest
from tests.conftest import VOCAB
from tests.engine_helpers import hf_greedy, penalised_greedy, run_to_completion


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams(), seed=0, draft_len=0)


def _propose(rows: list[list[int]], draft_lens: list[int], min_n: int = 2, max_n: int = 5
             ) -> tuple[list[list[int]], list[int]]:
    out = NgramProposer(min_n, max_n).propose([_seq(r) for r in rows], draft_lens)
    return [row[:n] for row, n in zip(out.tokens.tolist(), out.num_draft)], out.num_draft


# ---- the proposer --------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, draft_len, expected", [
    ([1, 2, 3, 4, 1, 2, 3], 3, [4, 1, 2]),  # suffix [1, 2, 3] seen at the start
    ([1, 2, 7, 1, 2, 8, 1, 2], 3, [8, 1, 2]),  # two earlier [1, 2]: the most recent one
    ([5, 1, 2, 9, 1, 2, 7, 5, 1, 2], 2, [9, 1]),  # the longer match [5, 1, 2] wins over the recent [1, 2]
    ([1, 2, 1, 2], 5, [1, 2]),  # fewer tokens than asked: the match is followed by two only
    ([1, 2, 3, 4], 3, []),  # nothing repeats
    ([1, 9, 1], 3, []),  # a 1-gram only, below prompt_lookup_min
    ([4, 4, 4, 4], 3, [4]),  # overlapping occurrences count; the most recent leaves one token
    ([7], 3, []),
])
def test_proposes_what_followed_the_longest_most_recent_match(tokens, draft_len, expected):
    drafts, counts = _propose([tokens], [draft_len])
    assert drafts == [expected] and counts == [len(expected)]


def test_min_and_max_bound_the_ngram_length():
    assert _propose([[1, 9, 1]], [2], min_n=1, max_n=1)[0] == [[9, 1]]
    # With max 2, [1, 2] at the start ties [1, 2] later and the later one wins; with max 3 the
    # longer [0, 1, 2] picks the earlier occurrence.
    tokens = [0, 1, 2, 5, 3, 1, 2, 6, 0, 1, 2]
    assert _propose([tokens], [1], max_n=2)[0] == [[6]]
    assert _propose([tokens], [1], max_n=3)[0] == [[5]]


def test_rows_of_a_batch_are_independent_and_padding_never_matches():
    rows = [[3], [1, 2, 3, 1, 2], [9, 9, 1, 2, 3, 4, 1, 2, 3], [5, 6, 5, 6]]
    drafts, counts = _propose(rows, [4, 4, 4, 0])
    assert drafts == [[], [3, 1, 2], [4, 1, 2, 3], []] and counts == [0, 3, 4, 0]
    # Padded drafts are valid ids (they go through the target's embedding).
    out = NgramProposer(2, 5).propose([_seq(r) for r in rows], [4, 4, 4, 0])
    assert out.tokens.shape == (4, 4) and out.probs is None and (out.tokens >= 0).all()


def test_the_batch_is_verified_over_its_longest_proposal_only():
    """Columns past the longest proposal would be verified for nothing: none are sent. Where nothing
    matches, the proposal has no columns, and the verify step is the one-token decode of nospec."""
    proposer = NgramProposer(2, 5)
    nothing = proposer.propose([_seq([1, 2, 3, 4]), _seq([5, 6, 7])], [3, 3])
    assert nothing.tokens.shape == (2, 0) and nothing.num_draft == [0, 0]
    two = proposer.propose([_seq([1, 2, 1, 2]), _seq([5, 6, 7])], [4, 4])
    assert two.tokens.shape == (2, 2) and two.num_draft == [2, 0] and two.tokens[0].tolist() == [1, 2]


def _reference(tokens: list[int], draft_len: int, min_n: int, max_n: int) -> list[int]:
    """The definition, one n and one position at a time."""
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        if len(tokens) <= n:
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + draft_len]
    return []


def test_matches_the_definition_on_random_batches():
    rng = random.Random(0)
    for _ in range(50):
        rows = [[rng.randrange(4) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(1, 6))]
        lens = [rng.randint(0, 6) for _ in rows]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 6)
        drafts, _ = _propose(rows, lens, min_n, max_n)
        assert drafts == [_reference(r, n, min_n, max_n) if n else [] for r, n in zip(rows, lens)]


def test_the_index_kept_between_steps_follows_growing_sequences():
    """Each sequence keeps the index that lets rows which cannot match skip the search; on sequences that
    grow by a few tokens a step (some steps not drafted at all), every proposal equals the definition."""
    rng = random.Random(1)
    proposer = NgramProposer(2, 4)
    seqs = [_seq([rng.randrange(5) for _ in range(rng.randint(1, 6))]) for _ in range(6)]
    for _ in range(30):
        lens = [rng.randint(0, 4) for _ in seqs]
        out = proposer.propose(seqs, lens)
        drafts = [row[:n] for row, n in zip(out.tokens.tolist(), out.num_draft)]
        assert drafts == [_reference(s.token_ids, n, 2, 4) if n else [] for s, n in zip(seqs, lens)]
        for seq in seqs:
            seq.token_ids += [rng.randrange(5) for _ in range(rng.randint(1, 4))]


# ---- the engine ------------------------------------------------------------------------------------

MAX_NEW = 40


def _repeating_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that copy themselves (a chunk said twice or more, then part of it): lookups find
    matches at once, and the target's continuation follows them only sometimes."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        chunk = rng.integers(0, VOCAB, rng.integers(4, 20)).tolist()
        prompts.append(rng.integers(0, VOCAB, rng.integers(0, 10)).tolist() + chunk * int(rng.integers(2, 4))
                       + chunk[: int(rng.integers(1, len(chunk)))])
    return prompts


@pytest.mark.parametrize("draft_len", [1, 4])
def test_greedy_output_equals_target_greedy_with_prompt_lookup(pair, draft_len):
    target, _ = pair
    prompts = _repeating_prompts(12, seed=draft_len)
    config = EngineConfig(max_model_len=320, max_num_seqs=8, num_speculative_tokens=draft_len, max_draft_len=8,
                          prefill_chunk_tokens=32, idle_prefill_tokens=64)
    engine = EngineCore.colocated(target, None, config, proposer=NgramProposer(2, 5))
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    outputs = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(target, p, MAX_NEW), f"prompt {i} diverged"
    stats = engine.total_stats
    # Lookups were made, and some of their tokens were accepted and some rejected.
    assert stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats.to_dict()
    assert engine.draft is None and engine.verifier.pool.num_used == 0


def test_penalised_greedy_output_with_prompt_lookup_equals_the_penalised_target(llama_pair):
    """A lookup's q is a point mass; the verifier compares it with the penalised p (counting the
    lookup's earlier tokens): a repetition penalty makes the copies it proposes lose, and the output
    is still the target's own under the penalties."""
    target, _ = llama_pair
    prompts = _repeating_prompts(12, seed=5)
    config = EngineConfig(max_model_len=320, max_num_seqs=8, num_speculative_tokens=4, prefill_chunk_tokens=32,
                          idle_prefill_tokens=64)
    engine = EngineCore.colocated(target, None, config, proposer=NgramProposer(2, 5))
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.1)
    outputs = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == penalised_greedy(target, p, params, eos_ids=set()), f"prompt {i} diverged"
    assert 0 < engine.total_stats.num_accepted_tokens < engine.total_stats.num_draft_tokens


def test_sampled_requests_run_and_are_reproducible_by_seed(llama_pair):
    target, _ = llama_pair
    prompts = _repeating_prompts(4, seed=9)
    config = EngineConfig(max_model_len=320, max_num_seqs=8, num_speculative_tokens=4)

    def run() -> dict[str, list[int]]:
        engine = EngineCore.colocated(target, None, config, proposer=NgramProposer(1, 3))
        params = {str(i): (p, SamplingParams(max_tokens=30, temperature=0.8, seed=i, ignore_eos=True))
                  for i, p in enumerate(prompts)}
        out = run_to_completion(engine, params)
        assert engine.total_stats.num_draft_tokens > 0
        return out

    first = run()
    assert first == run() and all(len(t) == 30 for t in first.values())


# ---- config and lanes ------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def test_config_takes_ngram_and_keeps_draft_models():
    cfg = AppConfig.model_validate({"mode": "pdv", "draft": NGRAM})
    assert cfg.ngram == NgramSpec(**NGRAM) and cfg.draft_model is None
    assert AppConfig.model_validate({"mode": "spec", "draft": {"method": "ngram"}}).ngram.prompt_lookup_max == 5
    model = AppConfig.model_validate({"mode": "pd", "draft": {"path": "/some/draft"}})
    assert model.draft_model.path == "/some/draft" and model.ngram is None
    assert AppConfig().draft_model is not None  # the shipped default is still the draft model
    assert AppConfig.model_validate({"mode": "nospec", "draft": NGRAM}).ngram is None


def test_shipped_ngram_yaml_validates():
    (app,) = yaml.safe_load((REPO_ROOT / "configs" / "ngram.yaml").read_text())["applications"]
    cfg = AppConfig.model_validate(app["args"])
    assert cfg.ngram == NgramSpec(**NGRAM) and cfg.draft_model is None


@pytest.mark.parametrize("draft, message", [
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min must be <="),
    ({"method": "ngram", "prompt_lookup_min": 0}, "greater than or equal to 1"),
    ({"method": "ngram", "prompt_lookup_max": 99}, "less than or equal to 32"),
    ({"method": "eagle"}, "Input should be 'ngram'"),
    ({"method": "ngram", "path": "models/vpd-draft"}, "Extra inputs are not permitted"),
    ({"method": "ngram", "prompt_lookup": 3}, "Extra inputs are not permitted"),
])
def test_config_refuses_bad_ngram_drafts(draft, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate({"mode": "unified", "draft": draft})


@pytest.fixture(scope="module")
def tiny_target(pair_paths) -> str:
    return pair_paths[0]


@pytest.mark.parametrize("mode", ["spec", "unified", "pd", "pdv"])
def test_lanes_of_every_drafting_mode_load_no_draft_model(tiny_target, mode):
    cfg = AppConfig.model_validate({"mode": mode, "target": {"path": tiny_target}, "draft": NGRAM,
                                    "engine": {"max_model_len": 128, "max_num_seqs": 2}})
    # pd and pdv reach their other lanes through Ray handles; the engine is built before any call.
    engine = build_engine(cfg, loop=None)
    assert engine.draft is None and isinstance(engine.proposer, NgramProposer)
    assert engine.proposer.device.type == "cpu" and engine.default_draft_len == 4
    assert engine.vocab_size == len(engine.tokenizer) and engine.eos_ids == {engine.tokenizer.eos_token_id}
    if mode in ("pd", "pdv"):
        prefiller = build_prompt_prefiller(cfg)
        (kv,) = prefiller.prefill([PrefillRequest("a", [5, 6, 7], SamplingParams(), seed=0)])
        assert prefiller.draft is None and kv.draft_kv is None and kv.target_kv.shape[3] == 3
