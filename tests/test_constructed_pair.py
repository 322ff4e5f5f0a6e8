"""Constructed pairs: the next-token map holds, the layers still do real work, and the acceptance the
engine measures through ordinary verification is the designed one."""

import pytest
import torch

from benchmarks.constructed_pair import (SMALL_DRAFT, SMALL_TARGET, acceptance_counters, build_constructed_pair,
                                         map_fidelity, measure_acceptance, predicted_acceptance, probe_prompts,
                                         residual_share, run_engine, successor_maps)
from tests.engine_helpers import hf_greedy, random_prompts

VOCAB = SMALL_TARGET["vocab_size"]
DRAFT_LEN = 4
NUM_PROMPTS, MAX_TOKENS = 24, 64
# ~1,400 judged tokens per run (~900 with the 16 prompts of the sampled test): the per-token
# estimate's sd is <= 0.017, so 0.05 is about 3 sd or more, while a map that failed on a tenth of
# the tokens would miss it.
TOLERANCE = 0.05


@pytest.fixture(scope="module", params=[0.5, 0.8])
def constructed(request):
    target, draft = build_constructed_pair(SMALL_TARGET, SMALL_DRAFT, request.param, seed=0)
    return request.param, target, draft


def test_successor_maps_are_one_cycle_and_agree_on_the_designed_share():
    successor, draft_successor = successor_maps(VOCAB, 0.8, seed=3)
    assert sorted(draft_successor.tolist()) == list(range(VOCAB))  # a permutation: one predecessor per head row
    token, steps = 0, 0
    while True:  # greedy text walks one cycle through the whole vocabulary
        token, steps = successor[token].item(), steps + 1
        if token == 0:
            break
    assert steps == VOCAB
    assert (successor == draft_successor).sum().item() == round(0.8 * VOCAB)
    with pytest.raises(ValueError):
        successor_maps(VOCAB, 1 - 1 / VOCAB, seed=3)


def test_next_token_follows_the_map_while_every_layer_works(constructed):
    agreement, target, draft = constructed
    successor, draft_successor = successor_maps(VOCAB, agreement, seed=0)
    probes = probe_prompts(VOCAB, 8, seed=100)  # [8, 64] uniformly random tokens
    assert map_fidelity(target, successor, probes) >= 0.95
    assert map_fidelity(draft, draft_successor, probes) >= 0.95
    for model in (target, draft):
        layers = model.model.get_decoder().layers
        assert all(m.weight.abs().min() > 0 for m in layers.modules() if isinstance(m, torch.nn.Linear))
        # The layers move the residual stream by a tenth of its size or so: real work, map intact.
        assert 0.05 < residual_share(model, probes) < 0.5
    # Attention reads the context: the same last token after two contexts gives different logits.
    with torch.inference_mode():
        logits = target.model(torch.cat([probes[:2, :-1], probes[:1, -1:].expand(2, 1)], dim=1)).logits[:, -1]
    assert (logits[0] - logits[1]).abs().max() > 0.05


def test_engine_greedy_acceptance_is_the_designed_agreement_and_output_is_the_targets(constructed):
    agreement, target, draft = constructed
    prompts = random_prompts(NUM_PROMPTS, VOCAB, 4, 16, seed=1)
    outputs, stats = run_engine(target, draft, prompts, DRAFT_LEN, temperature=0.0, max_tokens=MAX_TOKENS, seed=0)
    counters = acceptance_counters(stats)
    assert abs(counters["per_token_acceptance"] - agreement) < TOLERANCE, counters
    for i in range(2):
        assert outputs[str(i)] == hf_greedy(target, prompts[i], MAX_TOKENS)


def test_sampled_acceptance_is_what_the_distributions_predict():
    # A soft head (sharpness 6): sampled acceptance sum_v min(p, q) is well above the greedy share,
    # so matching it shows the sampled path measures the distributions, not the argmaxes.
    target, draft = build_constructed_pair(SMALL_TARGET, SMALL_DRAFT, 0.5, seed=0, sharpness=6.0)
    predicted = predicted_acceptance(target, draft, probe_prompts(VOCAB, 8, seed=100))
    assert predicted["temperature_1"] > predicted["greedy"] + 4 * TOLERANCE
    measured = measure_acceptance(target, draft, 16, DRAFT_LEN, MAX_TOKENS, seed=2)
    for mode in ("greedy", "temperature_1"):
        assert abs(measured[mode]["per_token_acceptance"] - predicted[mode]) < TOLERANCE, (mode, measured[mode])
