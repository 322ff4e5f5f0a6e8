"""Greedy speculative decoding must reproduce the target's own greedy decoding token for token."""

import pytest

from lanes.sample.params import SamplingParams
from tests.conftest import VOCAB
from tests.engine_helpers import hf_greedy, penalised_greedy, random_prompts, run_to_completion, small_engine

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


@pytest.mark.parametrize("captured_at_start", [False, True])
@pytest.mark.parametrize("draft_len", [0, 3])
def test_prefill_replayed_in_width_buckets_keeps_greedy_output(pair, prompts_and_refs, draft_len, captured_at_start):
    """Whole-prompt prefill through GraphedPrefill (lanes/model/cuda_graphs.py): off CUDA its "graphs" run
    eagerly on the same padded static buffers, so this proves the padding to (batch, width) buckets
    changes no token, in both models' caches. With `captured_at_start` every graph is captured on the
    pad slot before the first request (EngineCore.capture_graphs, what serving does): no output
    changes, and no live step captures one."""
    target, draft = pair
    prompts, refs = prompts_and_refs
    engine = small_engine(target, draft, num_speculative_tokens=draft_len, cuda_graphs=True)
    runners = (engine.verifier.lane.runner, engine.draft)
    if captured_at_start:
        assert engine.capture_graphs() > 0
        captured = [(set(r.graphs.graphs), set(r.prefill_graphs.graphs)) for r in runners]
        assert all(prefill for _, prefill in captured)  # decode graphs need the Triton kernel (CUDA)
    requests = {str(i): (p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for i, p in enumerate(prompts)}
    outputs = run_to_completion(engine, requests)
    assert [outputs[str(i)] for i in range(len(prompts))] == refs
    # At L = 0 the engine writes no draft KV at prefill (PrefillLane's lazy_draft): only the target prefills.
    for runner in runners if draft_len else runners[:1]:
        assert runner.prefill_graphs.graphs, "no prefill took the graphed path"
    if captured_at_start:
        assert [(set(r.graphs.graphs), set(r.prefill_graphs.graphs)) for r in runners] == captured, \
            "a live step captured a graph that capture_graphs missed"


def test_nospec_engine_equals_target_greedy(llama_pair):
    target, _ = llama_pair
    prompts = random_prompts(6, VOCAB, 1, 90, seed=3)
    engine = small_engine(target, None)
    outputs = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=16, ignore_eos=True)) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(target, p, 16)


# Penalties change the greedy output; speculation must not (lanes/sample/penalties.py).
PENALISED = {
    "repetition": dict(repetition_penalty=1.3),
    "presence_frequency": dict(presence_penalty=1.2, frequency_penalty=0.6),
    "logit_bias": dict(logit_bias={7: 4.0, 11: -100.0, 40: 0.7}),
    "min_tokens": dict(min_tokens=10),  # with a stop token id that the plain greedy output emits early
    "all": dict(repetition_penalty=0.9, presence_penalty=-0.5, frequency_penalty=0.4, logit_bias={3: 2.0},
                min_tokens=3),
}


def _penalised_params(name: str, plain: list[int]) -> SamplingParams:
    stop = dict(stop_token_ids=[plain[2]]) if "min_tokens" in PENALISED[name] else {}
    return SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, **PENALISED[name], **stop)


@pytest.fixture(scope="module")
def penalised_refs(pair):
    """Per prompt: (prompt, {name: (params, the target's greedy output under them)})."""
    target, _ = pair
    prompts = random_prompts(6, VOCAB, 1, 60, seed=11)
    refs, plains = [], []
    for p in prompts:
        plain = hf_greedy(target, p, MAX_NEW)
        plains.append(plain)
        by_name = {}
        for name in PENALISED:
            params = _penalised_params(name, plain)
            by_name[name] = (params, penalised_greedy(target, p, params, eos_ids=set()))
        # The reference agrees with HF's own repetition penalty, and the penalties changed something.
        assert by_name["repetition"][1] == hf_greedy(target, p, MAX_NEW, repetition_penalty=1.3)
        assert len(by_name["min_tokens"][1]) > 10 and plain[2] not in by_name["min_tokens"][1][:10]
        refs.append((p, by_name))
    for name in PENALISED:
        changed = [by_name[name][1] != plain[: len(by_name[name][1])] for (_, by_name), plain in zip(refs, plains)]
        assert any(changed), name
    return refs


@pytest.mark.parametrize("draft_len", [None, 0, 2, 4])  # None: no draft model at all
@pytest.mark.parametrize("name", list(PENALISED))
def test_penalised_greedy_output_equals_the_penalised_target_greedy(pair, penalised_refs, name, draft_len):
    target, draft = pair
    engine = small_engine(target, draft if draft_len is not None else None, num_speculative_tokens=draft_len or 0)
    requests = {str(i): (p, by_name[name][0]) for i, (p, by_name) in enumerate(penalised_refs)}
    outputs = run_to_completion(engine, requests)
    for i, (p, by_name) in enumerate(penalised_refs):
        assert outputs[str(i)] == by_name[name][1], f"prompt {i} (len {len(p)}) diverged"
    if draft_len:
        assert engine.total_stats.num_accepted_tokens > 0
    if draft_len and name == "logit_bias":
        # The draft biases its own proposals as the target does (a draft that did not: ~0 accepted).
        assert engine.total_stats.acceptance_rate > 0.9
