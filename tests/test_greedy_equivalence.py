"""Greedy speculative decoding must reproduce the target's own greedy decoding token for token."""

import pytest

from lanes.params import SamplingParams
from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion, small_engine
from tests.conftest import VOCAB

NUM_PROMPTS = 20
MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts_and_refs(pair):
    target, _ = pair
    # Short and long prompts mixed; the long ones take several prefill chunks of 32 tokens.
    prompts = random_prompts(NUM_PROMPTS, VOCAB, 1, 150, seed=7)
    refs = [hf_greedy(target, p, MAX_NEW) for p in prompts]
    return prompts, refs


@pytest.mark.parametrize("draft_len", [0, 1, 3, 6])
def test_greedy_output_equals_target_greedy(pair, prompts_and_refs, draft_len):
    target, draft = pair
    prompts, refs = prompts_and_refs
    engine = small_engine(target, draft, num_speculative_tokens=draft_len)
    requests = {str(i): (p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for i, p in enumerate(prompts)}
    outputs = run_to_completion(engine, requests)
    for i, ref in enumerate(refs):
        assert outputs[str(i)] == ref, f"prompt {i} (len {len(prompts[i])}) diverged"
    stats = engine.total_stats
    if draft_len:
        # The perturbed draft must both hit and miss, or this test would not exercise rollback.
        assert 0.1 < stats.acceptance_rate < 0.97, stats.acceptance_rate
        assert max(stats.accepted_per_pos[:draft_len]) > 0
    else:
        assert stats.num_draft_tokens == 0
    assert engine.verifier.lane.runner.pool.num_used == 0 and engine.draft.pool.num_used == 0


def test_nospec_engine_equals_target_greedy(llama_pair):
    target, _ = llama_pair
    prompts = random_prompts(6, VOCAB, 1, 90, seed=3)
    engine = small_engine(target, None)
    outputs = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=16, ignore_eos=True)) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(target, p, 16)
