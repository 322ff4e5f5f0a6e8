"""The rejection rule on constructed distributions: exact cases, then the sampled distribution."""

import torch

from lanes.sample.params import SamplingParams
from lanes.sample.penalties import Penalties, PenaltyHistory
from lanes.sample.sampling import (
    STREAM_ACCEPT, STREAM_DRAFT, STREAM_TARGET, SamplingTensors, logits_to_probs, sample_from, uniform_noise,
)
from lanes.spec.rejection import greedy_verify, point_mass, rejection_sample
from tests.engine_helpers import reference_penalties, run_to_completion, small_engine

V = 6


def one_hot(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).double()


def test_perfect_match_accepts_all_and_adds_bonus():
    drafts = torch.tensor([[1, 2, 3]])
    q = one_hot([1, 2, 3])[None]
    p = one_hot([1, 2, 3, 5])[None]  # the target agrees, and its next token is 5
    out = rejection_sample(drafts, q, p, torch.tensor([3]), torch.full((1, 3), 0.999), torch.rand(1, 4, V))
    assert out.num_accepted.tolist() == [3]
    assert out.tokens.tolist() == [[1, 2, 3, 5]]


def test_early_mismatch_stops_at_first_rejection_with_target_token():
    drafts = torch.tensor([[1, 4, 3]])
    q = one_hot([1, 4, 3])[None]
    p = one_hot([1, 2, 3, 5])[None]  # disagrees at position 1, agrees again later (must not matter)
    out = rejection_sample(drafts, q, p, torch.tensor([3]), torch.full((1, 3), 0.5), torch.rand(1, 4, V))
    assert out.num_accepted.tolist() == [1]
    assert out.tokens.tolist() == [[1, 2, -1, -1]]


def test_rows_with_different_draft_lengths_and_zero():
    drafts = torch.tensor([[1, 2, 3], [4, 0, 0], [0, 0, 0]])
    q = torch.stack([one_hot([1, 2, 3]), one_hot([4, 0, 0]), one_hot([0, 0, 0])])
    p = torch.stack([one_hot([1, 2, 0, 5]), one_hot([4, 1, 0, 0]), one_hot([3, 0, 0, 0])])
    out = rejection_sample(drafts, q, p, torch.tensor([3, 1, 0]), torch.full((3, 3), 0.5), torch.rand(3, 4, V))
    assert out.num_accepted.tolist() == [2, 1, 0]
    # row 0: reject at 2 -> target's 0; row 1: its only draft accepted -> bonus 1; row 2: plain decode -> 3
    assert out.tokens.tolist() == [[1, 2, 0, -1], [4, 1, -1, -1], [3, -1, -1, -1]]


def test_acceptance_probability_is_min_one_p_over_q():
    # q(x) = 0.8, p(x) = 0.2 -> accept with probability 0.25: u = 0.24 accepts, u = 0.26 rejects.
    q = torch.tensor([[[0.8, 0.2, 0, 0, 0, 0]]]).double()
    p = torch.tensor([[[0.2, 0.8, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]]).double()
    args = (torch.tensor([[0]]), q, p, torch.tensor([1]))
    assert rejection_sample(*args, torch.tensor([[0.24]]), torch.rand(1, 2, V)).num_accepted.tolist() == [1]
    rejected = rejection_sample(*args, torch.tensor([[0.26]]), torch.rand(1, 2, V))
    assert rejected.num_accepted.tolist() == [0]
    assert rejected.tokens[0, 0].item() == 1  # the residual max(0, p - q) puts all mass on token 1


# ---- statistics ------------------------------------------------------------------------------

N = 40_000
L = 3
P = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.10, 0.05], [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
                  [0.40, 0.05, 0.05, 0.05, 0.05, 0.40], [0.10, 0.30, 0.10, 0.30, 0.10, 0.10]]).double()
Q = torch.tensor([[0.10, 0.10, 0.10, 0.20, 0.30, 0.20], [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
                  [0.05, 0.40, 0.40, 0.05, 0.05, 0.05]]).double()
# Chi-square over 5 degrees of freedom: P(stat > 30) < 1e-5 under the null.
CHI2_BOUND = 30.0


def _draws() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    seeds = torch.arange(N, dtype=torch.long) * 7919 + 17
    positions = torch.arange(L + 1)[None].expand(N, -1)
    q = Q[None].expand(N, -1, -1)
    drafts = sample_from(q, uniform_noise(seeds, positions[:, :L], STREAM_DRAFT, V))
    return seeds, positions, q, drafts


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    expected = probs * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def _column_chi2s(tokens: torch.Tensor) -> list[float]:
    # Every emitted token at column c was drawn, given its prefix, from P[c] (context-free here),
    # so the tokens present at each column must follow P[c] whatever happened before.
    return [_chi2(tokens[:, c][tokens[:, c] >= 0], P[c]) for c in range(L + 1)]


def test_sampled_tokens_follow_target_distribution():
    seeds, positions, q, drafts = _draws()
    p = P[None].expand(N, -1, -1)
    out = rejection_sample(drafts, q, p, torch.full((N,), L), uniform_noise(seeds, positions[:, :L], STREAM_ACCEPT),
                           uniform_noise(seeds, positions, STREAM_TARGET, V))
    for stat in _column_chi2s(out.tokens):
        assert stat < CHI2_BOUND, stat
    # ...and not the draft's distribution, which the draft tokens themselves follow.
    assert _chi2(out.tokens[:, 0], Q[0]) > 100 * CHI2_BOUND
    assert _chi2(drafts[:, 0], Q[0]) < CHI2_BOUND


def test_the_bound_rejects_wrong_rules():
    """The same statistic fails for the rules an implementation might get wrong."""
    seeds, positions, q, drafts = _draws()
    u_accept = uniform_noise(seeds, positions[:, :L], STREAM_ACCEPT)
    target_sample = sample_from(P[None].expand(N, -1, -1), uniform_noise(seeds, positions, STREAM_TARGET, V))
    # (a) no residual: on rejection, sample p itself instead of norm(max(0, p - q)).
    accept = u_accept[:, 0] * Q[0, drafts[:, 0]] < P[0, drafts[:, 0]]
    no_residual = torch.where(accept, drafts[:, 0], target_sample[:, 0])
    assert _chi2(no_residual, P[0]) > 10 * CHI2_BOUND
    # (b) greedy match only: accept a draft iff it is the target's argmax, else the target's argmax.
    greedy_match = torch.where(drafts[:, 0] == P[0].argmax(), drafts[:, 0], P[0].argmax().expand(N))
    assert _chi2(greedy_match, P[0]) > 10 * CHI2_BOUND
    # (c) always accept the draft.
    assert _chi2(drafts[:, 0], P[0]) > 10 * CHI2_BOUND


def test_point_mass_proposals_keep_the_target_distribution():
    """Prompt lookup drafts a fixed token with q one-hot at it: accepted with probability p(x), and
    on rejection the residual is p without x. Every column still follows P."""
    seeds, positions, _, _ = _draws()
    lookup = torch.tensor([0, 4, 1]).expand(N, -1)  # likely, middling and unlikely under P[0..2]
    q = point_mass(lookup, V, torch.float64)
    p = P[None].expand(N, -1, -1)
    u_accept = uniform_noise(seeds, positions[:, :L], STREAM_ACCEPT)
    out = rejection_sample(lookup, q, p, torch.full((N,), L), u_accept, uniform_noise(seeds, positions, STREAM_TARGET, V))
    for stat in _column_chi2s(out.tokens):
        assert stat < CHI2_BOUND, stat
    accept_rate = (out.num_accepted > 0).double().mean().item()
    assert abs(accept_rate - P[0, 0].item()) < 0.01, accept_rate
    assert 0 < out.num_accepted.max() <= L and (out.num_accepted == 0).any()
    # The same statistic catches a rule that samples p itself after rejecting the lookup.
    target_sample = sample_from(p, uniform_noise(seeds, positions, STREAM_TARGET, V))
    no_residual = torch.where(u_accept[:, 0] < P[0, 0], lookup[:, 0], target_sample[:, 0])
    assert _chi2(no_residual, P[0]) > 10 * CHI2_BOUND


def test_greedy_fast_path_equals_the_general_rule_on_one_hot_inputs():
    gen = torch.Generator().manual_seed(3)
    batch, max_draft, vocab = 64, 5, 7  # a small vocabulary makes matches frequent
    logits = torch.randn(batch, max_draft + 1, vocab, generator=gen)
    target = logits.argmax(-1)
    # Drafts agree with the target on a random prefix, then guess.
    drafts = torch.where(torch.rand(batch, max_draft, generator=gen) < 0.7, target[:, :max_draft],
                         torch.randint(0, vocab, (batch, max_draft), generator=gen))
    num_draft = torch.randint(0, max_draft + 1, (batch,), generator=gen)
    fast = greedy_verify(drafts, logits, num_draft)
    general = rejection_sample(drafts, torch.nn.functional.one_hot(drafts, vocab).double(),
                               torch.nn.functional.one_hot(target, vocab).double(), num_draft,
                               torch.rand(batch, max_draft, generator=gen), torch.rand(batch, max_draft + 1, vocab, generator=gen))
    assert torch.equal(fast.num_accepted, general.num_accepted)
    assert torch.equal(fast.tokens, general.tokens)
    assert 0 < fast.num_accepted.float().mean() < max_draft  # both hits and misses happened


def test_sampled_tokens_follow_a_min_p_filtered_target():
    """min-p filters the target's distribution before the accept test (lanes/sample/sampling.py): the emitted
    tokens follow the filtered target, and a token min-p removed is never emitted, even where the
    draft (filtered by its own logits) proposes it often."""
    seeds, positions, _, _ = _draws()
    params = [SamplingParams(temperature=1.0, min_p=0.5)]
    target_st = SamplingTensors.build(params * N, [0] * N, "cpu")
    p_filtered = logits_to_probs(P.log()[None].float(), SamplingTensors.build(params, [0], "cpu"))[0].double()
    assert (p_filtered == 0).sum() >= 6 and (p_filtered[P < 0.5 * P.amax(-1, keepdim=True)] == 0).all()
    q = Q[None].expand(N, -1, -1)  # the draft proposes filtered-out tokens too
    drafts = sample_from(q, uniform_noise(seeds, positions[:, :L], STREAM_DRAFT, V))
    p = logits_to_probs(P.log()[None].expand(N, -1, -1).float(), target_st).double()
    out = rejection_sample(drafts, q, p, torch.full((N,), L), uniform_noise(seeds, positions[:, :L], STREAM_ACCEPT),
                           uniform_noise(seeds, positions, STREAM_TARGET, V))
    for c in range(L + 1):
        tokens = out.tokens[:, c][out.tokens[:, c] >= 0]
        assert (p_filtered[c, tokens] > 0).all()  # no filtered-out token, ever
        kept = p_filtered[c] > 0
        counts = torch.bincount(tokens, minlength=V).double()[kept]
        expected = p_filtered[c, kept] * len(tokens)
        assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_BOUND
    # The unfiltered target fails the same statistic: the filter changed the distribution.
    assert _chi2(out.tokens[:, 0], P[0]) > 10 * CHI2_BOUND


# Output so far (two 0s) and prompt ([5]) of the penalised request below.
PENALISED = SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5)


def _penalised_target(column: int, prefix: list[int]) -> torch.Tensor:
    """The penalised P[column] after `prefix` drafts, written out from vLLM's definitions."""
    output = [0, 0] + prefix
    logits = P[column].log().clone()
    for t in range(V):
        if t in output or t == 5:
            logits[t] = logits[t] / 1.5 if logits[t] > 0 else logits[t] * 1.5
        logits[t] -= 0.5 * output.count(t) + 1.0 * (t in output)
    return torch.softmax(logits, dim=-1)


def _sample_penalised(count_drafts: bool) -> torch.Tensor:
    seeds, positions, q, drafts = _draws()
    history = PenaltyHistory(list(range(N)), [[5]] * N, [[0, 0]] * N, [2] * N)
    penalties = Penalties.build([PENALISED] * N, history, V, "cpu")
    raw = P.log()[None].expand(N, -1, -1)
    logits = penalties.apply(raw, drafts if count_drafts else None)
    p = logits_to_probs(logits, SamplingTensors.build([PENALISED] * N, [0] * N, "cpu"))
    return rejection_sample(drafts, q, p, torch.full((N,), L), uniform_noise(seeds, positions[:, :L], STREAM_ACCEPT),
                            uniform_noise(seeds, positions, STREAM_TARGET, V)).tokens


def _column_one_chi2s(tokens: torch.Tensor) -> list[float]:
    # A token at column 1 exists only after draft 0 was accepted, so its prefix is that draft:
    # given it, the token follows P[1] penalised with the draft counted.
    stats = []
    for first in range(V):
        rows = (tokens[:, 0] == first) & (tokens[:, 1] >= 0)
        if rows.sum() >= 2000:
            stats.append(_chi2(tokens[rows, 1], _penalised_target(1, [first])))
    return stats


def test_sampled_tokens_follow_the_penalised_target_given_the_drafts_before_them():
    """Penalties make p at column c depend on the drafts before it (lanes/sample/penalties.py). The emitted
    tokens follow the penalised target: column 0 the one of the committed output, column 1 the one
    that also counts the accepted draft 0."""
    tokens = _sample_penalised(count_drafts=True)
    assert _chi2(tokens[:, 0], _penalised_target(0, [])) < CHI2_BOUND
    assert _chi2(tokens[:, 0], P[0]) > 10 * CHI2_BOUND  # the penalties changed the distribution
    stats = _column_one_chi2s(tokens)
    assert len(stats) >= 3 and max(stats) < CHI2_BOUND, stats
    # A verifier that penalised every column by the committed output only fails the same statistic.
    stale = _column_one_chi2s(_sample_penalised(count_drafts=False))
    assert max(stale) > 10 * CHI2_BOUND, stale


# ---- the whole engine, sampled, under penalties ---------------------------------------------------

ENGINE_SAMPLES = 6000
ENGINE_PROMPT = [5, 17, 3, 17, 90]
ENGINE_PARAMS = dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.5,
                     max_tokens=3, ignore_eos=True)


def _chi2_bound(df: int, z: float = 4.265) -> float:
    """The chi-square quantile exceeded with probability ~1e-5 (Wilson-Hilferty; z is that tail's)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _binned_chi2(tokens: torch.Tensor, probs: torch.Tensor, min_expected: float = 10.0) -> tuple[float, int]:
    """Chi-square of `tokens` against `probs` [V], the bins expecting fewer than `min_expected` pooled."""
    counts, expected = torch.bincount(tokens, minlength=len(probs)).double(), probs.double() * len(tokens)
    small = expected < min_expected
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    return float(((counts - expected) ** 2 / expected.clamp_min(1e-12)).sum()), len(counts) - 1


def _penalised_next(model, sequences: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """The penalised next-token distribution after each of `sequences` (prompt + output): [N, V]."""
    with torch.no_grad():
        logits = model.model(torch.tensor(sequences)).logits[:, -1].double()
    n = len(ENGINE_PROMPT)
    return torch.stack([torch.softmax(reference_penalties(row, s[:n], s[n:], params, set()), dim=-1)
                        for row, s in zip(logits, sequences)])


def test_the_spec_engine_samples_the_penalised_target(llama_pair):
    """Sampled requests through the whole engine (prefill, draft, verify): the third output token is a
    bonus at column 1 after the second was drafted and accepted, or comes from the next step. Either
    way it follows the penalised target, which counts the second token: here computed exactly from
    the model, marginalised over the first two tokens."""
    target, draft = llama_pair
    engine = small_engine(target, draft, num_speculative_tokens=2, max_num_seqs=64, max_model_len=32,
                          prefill_chunk_tokens=320, idle_prefill_tokens=640)
    requests = {str(i): (ENGINE_PROMPT, SamplingParams(seed=i, **ENGINE_PARAMS)) for i in range(ENGINE_SAMPLES)}
    done = run_to_completion(engine, requests)
    outputs = torch.tensor([done[str(i)] for i in range(ENGINE_SAMPLES)])  # [N, 3]
    assert engine.total_stats.num_accepted_tokens > 0.3 * ENGINE_SAMPLES  # many bonus tokens at column 1

    params = SamplingParams(**ENGINE_PARAMS)
    vocab = target.model.config.vocab_size
    p1 = _penalised_next(target, [ENGINE_PROMPT], params)[0]  # [V]
    p2 = _penalised_next(target, [ENGINE_PROMPT + [a] for a in range(vocab)], params)  # [V, V]: t2 | t1
    pairs = [ENGINE_PROMPT + [a, b] for a in range(vocab) for b in range(vocab)]
    p3 = _penalised_next(target, pairs, params).view(vocab, vocab, vocab)  # t3 | t1, t2
    joint12 = p1[:, None] * p2  # [V, V]
    marginal3 = (joint12[..., None] * p3).sum(dim=(0, 1))
    for tokens, probs in ((outputs[:, 0], p1), (outputs[:, 1], joint12.sum(0)), (outputs[:, 2], marginal3)):
        stat, df = _binned_chi2(tokens, probs)
        assert stat < _chi2_bound(df), (stat, df)
    # The presence penalty makes a repeat of the second token rare; a verifier that did not count the
    # accepted draft would emit it far more often.
    repeat = float((joint12 * p3.diagonal(dim1=1, dim2=2)).sum())  # P(t3 == t2)
    observed = float((outputs[:, 2] == outputs[:, 1]).double().mean())
    assert abs(observed - repeat) < 4.5 * (repeat * (1 - repeat) / ENGINE_SAMPLES) ** 0.5 + 1e-3, (observed, repeat)
