"""Penalties and constraints on constructed logits: vLLM's formulas, the counts each verify column
sees (accepted, rejected and bonus), what travels, and what a request without them costs (nothing)."""

import pytest
import torch

from lanes.engine.sequence import Sequence
from lanes.sample.params import ParamError, SamplingParams
from lanes.sample.penalties import Penalties, PenaltyHistory, check_request
from lanes.spec.rejection import greedy_verify
from tests.conftest import VOCAB
from tests.engine_helpers import random_prompts, reference_penalties, run_to_completion, small_engine

V = 8


def _seq(prompt: list[int], output: list[int], **params) -> Sequence:
    seq = Sequence("r", prompt, SamplingParams(max_tokens=32, **params), seed=0, draft_len=0)
    seq.token_ids += output
    return seq


ROWS = [
    dict(repetition_penalty=1.7),
    dict(presence_penalty=1.5, frequency_penalty=-0.5),
    dict(logit_bias={3: 5.0, 6: -100.0}, min_tokens=4, stop_token_ids=[5]),
    dict(),  # no penalties: untouched, and carries no history
    dict(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=2.0, logit_bias={0: 1.0}, min_tokens=2),
]


def _batch():
    gen = torch.Generator().manual_seed(0)
    seqs = [_seq([1, 2, 2, 7], [4, 4, 1], **kw) for kw in ROWS]
    for seq in seqs:
        check_request(seq.params, V, eos_ids={7})
    drafts = torch.randint(0, V, (len(seqs), 3), generator=gen)
    logits = torch.randn(len(seqs), 4, V, generator=gen, dtype=torch.float64) * 3
    return seqs, drafts, logits


def test_every_column_counts_the_committed_output_plus_the_drafts_before_it():
    seqs, drafts, logits = _batch()
    history = PenaltyHistory.of(seqs)
    assert history.rows == [0, 1, 2, 4]  # the row without penalties carries nothing
    penalties = Penalties.build([s.params for s in seqs], history, V, "cpu")
    out = penalties.apply(logits, drafts)
    assert out.dtype == torch.float64
    for b, seq in enumerate(seqs):
        for c in range(4):
            output = seq.token_ids[seq.num_prompt_tokens:] + drafts[b, :c].tolist()
            expected = reference_penalties(logits[b, c], seq.prompt_ids, output, seq.params, eos_ids={7})
            assert torch.allclose(out[b, c], expected), (b, c, out[b, c], expected)
    assert torch.equal(out[3], logits[3])


def test_draft_steps_see_the_same_counts_as_the_verify_columns():
    """The draft penalises its proposal j with drafts[:j], column by column: the same values as verify."""
    seqs, drafts, logits = _batch()
    penalties = Penalties.build([s.params for s in seqs], PenaltyHistory.of(seqs), V, "cpu")
    whole = penalties.apply(logits, drafts)
    for j in range(4):
        step = penalties.apply(logits[:, j : j + 1], drafts[:, :j] if j else None, first=j)
        assert torch.equal(step[:, 0], whole[:, j])


def test_min_tokens_holds_eos_and_stop_ids_until_enough_output_exists():
    seq = _seq([1], [2], min_tokens=3, stop_token_ids=[5])
    check_request(seq.params, V, eos_ids={7})
    assert seq.params.min_tokens_stop_ids == [5, 7]
    logits = torch.zeros(1, 4, V)
    penalties = Penalties.build([seq.params], PenaltyHistory.of([seq]), V, "cpu")
    out = penalties.apply(logits, torch.zeros(1, 3, dtype=torch.long))
    # One output token committed: columns 0 and 1 (outputs 2 and 3) are held, then free.
    held = torch.isinf(out[0, :, [5, 7]]).all(dim=-1)
    assert held.tolist() == [True, True, False, False]
    assert not torch.isinf(out[0, :, :5]).any()
    ignoring = SamplingParams(min_tokens=3, ignore_eos=True)
    check_request(ignoring, V, eos_ids={7})
    assert ignoring.min_tokens_stop_ids == []  # ignore_eos: EOS is never held, as vLLM's all_stop_token_ids


def test_greedy_verify_on_penalised_logits_accepts_rejects_and_adds_the_bonus_by_the_running_counts():
    """Raw argmax is token 2, then 3, then 4 at every column. A presence penalty makes a token drafted
    at column c lose at every later column: the accept, the reject and the bonus all depend on the
    drafts before them, not only on the committed output."""
    raw = torch.tensor([0.0, 0.0, 3.0, 2.5, 1.5, 0.0, 0.0, 0.0]).expand(2, 4, V)
    seqs = [_seq([0], [], presence_penalty=2.0), _seq([0], [], presence_penalty=2.0)]
    penalties = Penalties.build([s.params for s in seqs], PenaltyHistory.of(seqs), V, "cpu")
    drafts = torch.tensor([[2, 3, 4], [2, 2, 3]])
    out = greedy_verify(drafts, penalties.apply(raw, drafts), torch.tensor([3, 3]))
    # Row 0: 2 (nothing yet), 3 (2 penalised), 4 (2 and 3 penalised) accepted; bonus: all three penalised -> 2
    # Row 1: 2 accepted, then the second 2 is rejected: 2 is penalised (1.0 < 3's 2.5) -> recovered 3.
    assert out.num_accepted.tolist() == [3, 1]
    assert out.tokens.tolist() == [[2, 3, 4, 2], [2, 3, -1, -1]]
    # Without the drafts' counts the bonus and the rejection would differ: the cumulative count matters.
    stale = greedy_verify(drafts, penalties.apply(raw), torch.tensor([3, 3]))
    assert stale.tokens.tolist() != out.tokens.tolist()


def test_rows_without_penalties_build_nothing():
    seqs = [_seq([1, 2], [3]), _seq([4], [], temperature=1.0, top_k=3)]
    assert PenaltyHistory.of(seqs) is None
    assert Penalties.build([s.params for s in seqs], None, V, "cpu") is None


def test_history_travels_for_penalised_rows_only_and_follows_select_and_merge():
    seqs = [_seq([1], [2]), _seq([3, 3], [4], repetition_penalty=1.2), _seq([5], [6, 6], min_tokens=9)]
    history = PenaltyHistory.of(seqs)
    assert history.rows == [1, 2]
    assert [ids.tolist() for ids in history.prompt_ids] == [[3], []]  # distinct prompt ids, once a request
    assert history.output_ids == [[4], []]  # min_tokens: a count only
    assert history.num_output == [1, 2]
    assert history.select([2, 0]).rows == [0] and history.select([0]) is None
    merged = PenaltyHistory.merge([None, history, history.select([2])], [2, 3, 1])
    assert merged.rows == [3, 4, 5] and merged.num_output == [1, 2, 2]
    assert PenaltyHistory.merge([None, None], [1, 2]) is None


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=40), "min_tokens"),  # > max_tokens
])
def test_out_of_range_values_name_their_field(kwargs, field):
    with pytest.raises(ParamError) as err:
        SamplingParams(max_tokens=32, **kwargs)
    assert err.value.field == field


def test_logit_bias_is_clamped_and_its_ids_checked_against_the_vocabulary():
    params = SamplingParams(logit_bias={1: 250.0, 2: -1e9, 3: 0.5})
    assert params.logit_bias == {1: 100.0, 2: -100.0, 3: 0.5}
    with pytest.raises(ParamError) as err:
        check_request(SamplingParams(logit_bias={V: 1.0}), V, set())
    assert err.value.field == "logit_bias"


@pytest.mark.parametrize("draft_len", [0, 3])
def test_sampled_penalised_requests_beside_plain_ones_reproduce_by_seed(llama_pair, draft_len):
    """Sampled rows with penalties, and rows without in the same batches: every request finishes, a
    seeded one gives the same tokens again, and min_tokens holds a stop id it would otherwise emit."""
    target, draft = llama_pair
    prompts = random_prompts(6, VOCAB, 2, 40, seed=4)

    def run() -> dict[str, list[int]]:
        engine = small_engine(target, draft, num_speculative_tokens=draft_len)
        requests = {}
        for i, p in enumerate(prompts):
            kwargs = dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={9: 2.0},
                          min_tokens=12, stop_token_ids=[9]) if i % 2 else {}
            requests[str(i)] = (p, SamplingParams(max_tokens=16, temperature=0.9, seed=i, ignore_eos=True, **kwargs))
        return run_to_completion(engine, requests)

    first = run()
    assert first == run()
    for i in range(1, len(prompts), 2):
        assert 9 not in first[str(i)][:12] and len(first[str(i)]) >= 12
