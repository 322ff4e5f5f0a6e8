"""Temperature, min-p, top-k and top-p filtering, and the counter-based sampler."""

import pytest
import torch

from lanes.sample.params import SamplingParams
from lanes.sample.sampling import SamplingTensors, logits_to_probs, sample_from, uniform_noise


def _probs(logits: list[float], **kwargs) -> torch.Tensor:
    st = SamplingTensors.build([SamplingParams(**kwargs)], [0], "cpu")
    return logits_to_probs(torch.tensor([[logits]]), st)[0, 0]


LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0]


def test_greedy_is_one_hot_at_argmax():
    assert _probs(LOGITS, temperature=0).tolist() == [1, 0, 0, 0, 0]


def test_temperature_scales_logits():
    torch.testing.assert_close(_probs(LOGITS, temperature=0.5), torch.softmax(torch.tensor(LOGITS) / 0.5, -1))


def test_top_k_keeps_k_largest():
    expected = torch.softmax(torch.tensor(LOGITS[:2]), -1).tolist() + [0, 0, 0]
    torch.testing.assert_close(_probs(LOGITS, temperature=1, top_k=2), torch.tensor(expected))


def test_top_p_keeps_smallest_prefix_reaching_p():
    full = torch.softmax(torch.tensor(LOGITS), -1)  # [0.53, 0.19, 0.12, 0.07, 0.03] (rounded)
    kept = _probs(LOGITS, temperature=1, top_p=0.8)
    # 0.53 + 0.19 = 0.72 < 0.8, so the third token (which crosses 0.8) stays, the rest go.
    torch.testing.assert_close(kept, torch.cat([full[:3] / full[:3].sum(), torch.zeros(2)]))


def test_top_p_one_keeps_every_token():
    logits = [30.0] + [0.0] * 9  # the tail's mass rounds the cumulative sum to 1.0 early
    assert (_probs(logits, temperature=1, top_p=1.0) > 0).all()


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_after_temperature():
    full = torch.softmax(torch.tensor(LOGITS), -1)
    # p_i / p_max = exp(l_i - 2): 1, 0.37, 0.22, 0.14, 0.05.
    kept = _probs(LOGITS, temperature=1, min_p=0.3)
    torch.testing.assert_close(kept, torch.cat([full[:2] / full[:2].sum(), torch.zeros(3)]))
    # At temperature 0.5 the ratios square (0.14 for the second token): min-p reads the scaled logits.
    assert _probs(LOGITS, temperature=0.5, min_p=0.3).tolist() == [1, 0, 0, 0, 0]
    assert (_probs(LOGITS, temperature=1, min_p=0.0) > 0).all()
    # With top-k and top-p: min-p first, then the others over what remains (vLLM's order).
    torch.testing.assert_close(_probs(LOGITS, temperature=1, min_p=0.1, top_k=3),
                               torch.cat([full[:3] / full[:3].sum(), torch.zeros(2)]))
    torch.testing.assert_close(_probs(LOGITS, temperature=1, min_p=0.2, top_p=0.5),
                               torch.tensor([1.0, 0, 0, 0, 0]))


def test_rows_use_their_own_parameters():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1, top_k=1), SamplingParams(temperature=1)]
    st = SamplingTensors.build(params, [0, 1, 2], "cpu")
    probs = logits_to_probs(torch.tensor([[LOGITS]] * 3), st)[:, 0]
    assert probs[0].tolist() == [1, 0, 0, 0, 0] and probs[1].tolist() == [1, 0, 0, 0, 0]
    assert (probs[2] > 0).all()


def test_noise_depends_on_seed_position_and_stream_only():
    seeds = torch.tensor([5, 5, 6])
    u = uniform_noise(seeds, torch.tensor([[3], [3], [3]]), stream=1, vocab_size=64)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert not torch.equal(u, uniform_noise(seeds, torch.tensor([[4], [4], [4]]), 1, 64))
    assert not torch.equal(u, uniform_noise(seeds, torch.tensor([[3], [3], [3]]), 2, 64))
    assert 0 < u.min() and u.max() < 1


def test_sampler_frequencies_match_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 50_000
    u = uniform_noise(torch.arange(n), torch.zeros(n, 1, dtype=torch.long), 3, 4)
    tokens = sample_from(probs.expand(n, 1, 4), u)[:, 0]
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert torch.allclose(freq, probs.double(), atol=0.01), freq


@pytest.mark.parametrize("bad", [{"temperature": float("nan")}, {"top_k": 1.5}, {"seed": "x"}, {"max_tokens": True},
                                 {"min_p": -0.1}, {"min_p": 1.5}, {"min_p": float("nan")}, {"min_p": True}])
def test_params_reject_wrong_types(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
