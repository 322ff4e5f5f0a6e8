"""Logprobs are the target's own raw log_softmax, whatever produced the token: the prefill forward,
an accepted draft, a correction after a rejected draft, or a bonus token. Models in float64."""

import pytest
import torch

from lanes.engine.core import EngineCore
from lanes.sample.params import ParamError, SamplingParams
from tests.conftest import VOCAB
from tests.engine_helpers import random_prompts, small_engine

TOL = 1e-5
MAX_NEW = 20
K = 5


def run_chunks(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Every output chunk per request, in order (a chunk is one step's tokens)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    chunks: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_work:
        for out in engine.step():
            assert out.error is None, out.error
            chunks[out.request_id].append(out)
    return chunks


def per_token(chunks: list, draft_len: int, max_tokens: int) -> list[tuple[int, float, list[int], list[float], str]]:
    """(token, logprob, top ids, top logprobs, kind) for every emitted token; kind says what emitted
    it: the prefill forward, an accepted draft, the correction at a rejected draft, or the bonus."""
    rows, emitted = [], 0
    for i, out in enumerate(c for c in chunks if c.token_ids):
        lp = out.logprobs
        assert lp is not None and len(lp) == len(out.token_ids)
        if i == 0:
            kinds = ["prefill"]
        else:
            drafted = max(0, min(draft_len, max_tokens - emitted - 1))  # Sequence.step_draft_len
            last = "bonus" if len(out.token_ids) == drafted + 1 else "correction"
            kinds = ["accepted"] * (len(out.token_ids) - 1) + [last]
        for j, token in enumerate(out.token_ids):
            rows.append((token, lp.logprobs[j], lp.top_ids[j], lp.top_logprobs[j], kinds[j]))
        emitted += len(out.token_ids)
    return rows


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits at every position of `ids`, straight from HF: [len, V]."""
    with torch.no_grad():
        logits = model.model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, VOCAB, 3, 70, seed=11)


def test_spec_logprobs_equal_nospec_at_accepted_corrected_and_bonus_tokens(llama_pair, prompts):
    target, draft = llama_pair
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=K)
    requests = {str(i): (p, params) for i, p in enumerate(prompts)}
    nospec = run_chunks(small_engine(target, None), requests)
    spec = run_chunks(small_engine(target, draft, num_speculative_tokens=4), requests)
    kinds = set()
    for rid in requests:
        ref, got = per_token(nospec[rid], 0, MAX_NEW), per_token(spec[rid], 4, MAX_NEW)
        assert [r[0] for r in got] == [r[0] for r in ref], f"request {rid}: greedy tokens diverged"
        for (token, logprob, top_ids, top_lps, kind), (_, ref_lp, ref_ids, ref_top, _) in zip(got, ref):
            kinds.add(kind)
            assert abs(logprob - ref_lp) < TOL, (rid, kind)
            assert top_ids == ref_ids and max(abs(a - b) for a, b in zip(top_lps, ref_top)) < TOL, (rid, kind)
            # Greedy: the emitted token is the most likely one, and its logprob is the top logprob.
            assert top_ids[0] == token and abs(top_lps[0] - logprob) < 1e-12
            assert len(top_ids) == K and top_lps == sorted(top_lps, reverse=True)
    assert kinds == {"prefill", "accepted", "correction", "bonus"}, kinds


def test_sampled_logprobs_are_raw_target_logprobs(llama_pair, prompts):
    """Temperature and top-k change which token is drawn, not the logprobs reported (vLLM's raw mode):
    every token's logprob equals the target's log_softmax in context, computed by HF."""
    target, draft = llama_pair
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_k=40, seed=5, logprobs=K)
    chunks = run_chunks(small_engine(target, draft, num_speculative_tokens=3),
                        {str(i): (p, params) for i, p in enumerate(prompts)})
    kinds = set()
    for i, prompt in enumerate(prompts):
        rows = per_token(chunks[str(i)], 3, MAX_NEW)
        ids = prompt + [r[0] for r in rows]
        ref = hf_logprobs(target, ids)[len(prompt) - 1 : -1]  # [MAX_NEW, V] the position before each token
        for j, (token, logprob, top_ids, top_lps, kind) in enumerate(rows):
            kinds.add(kind)
            assert abs(logprob - ref[j, token].item()) < TOL, (i, j, kind)
            values, indices = ref[j].topk(K)
            assert top_ids == indices.tolist() and torch.allclose(torch.tensor(top_lps, dtype=torch.float64), values,
                                                                    atol=TOL)
    assert {"correction", "accepted"} <= kinds, kinds


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_prompt_logprobs_equal_hf_log_softmax(llama_pair, max_tokens):
    """Prompt logprobs over several prefill chunks (32 tokens a chunk) equal HF's; max_tokens 0 scores
    the prompt and generates nothing. A request beside it that asked for nothing gets nothing."""
    target, draft = llama_pair
    prompt = random_prompts(1, VOCAB, 90, 90, seed=4)[0]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=3)
    chunks = run_chunks(small_engine(target, draft),
                        {"echo": (prompt, params), "plain": ([5, 6, 7], SamplingParams(max_tokens=3))})
    first = chunks["echo"][0]
    lp = first.prompt_logprobs
    assert lp is not None and len(lp) == len(prompt) - 1
    assert sum(c.prompt_logprobs is not None for c in chunks["echo"]) == 1  # sent once, on the first chunk
    ref = hf_logprobs(target, prompt)[:-1]  # position j scores prompt token j + 1
    assert torch.allclose(torch.tensor(lp.logprobs, dtype=torch.float64), ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0],
                          atol=TOL)
    values, indices = ref.topk(3)
    assert lp.top_ids == indices.tolist()
    assert torch.allclose(torch.tensor(lp.top_logprobs, dtype=torch.float64), values, atol=TOL)
    assert sum(len(c.token_ids) for c in chunks["echo"]) == max_tokens
    assert chunks["echo"][-1].finish_reason == "length"
    assert all(c.logprobs is None and c.prompt_logprobs is None for c in chunks["plain"])


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"logprobs": 2, "max_tokens": 0}, "max_tokens"),
])
def test_bad_logprobs_fields_are_named(kwargs, field):
    with pytest.raises(ParamError) as info:
        SamplingParams(**{"max_tokens": 4, **kwargs})
    assert info.value.field == field


@pytest.mark.parametrize("draft_len", [0, 3])
def test_logprobs_stay_raw_under_penalties(llama_pair, prompts, draft_len):
    """vLLM's default: logprobs are taken before penalties, logit_bias and min_tokens. A bias of 100 on
    one token makes it every output token, and its logprob is still the target's own."""
    target, draft = llama_pair
    engine = small_engine(target, draft, num_speculative_tokens=draft_len)
    forced = 17
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=K, logit_bias={forced: 100.0},
                            repetition_penalty=1.5, presence_penalty=2.0)
    chunks = run_chunks(engine, {"r": (prompts[0], params)})["r"]
    rows = per_token(chunks, draft_len, MAX_NEW)
    assert [token for token, *_ in rows] == [forced] * MAX_NEW
    raw = hf_logprobs(target, prompts[0] + [forced] * MAX_NEW)[len(prompts[0]) - 1 : -1]  # [MAX_NEW, V]
    for j, (token, logprob, top_ids, top_logprobs, _) in enumerate(rows):
        assert abs(logprob - raw[j, token].item()) < TOL
        assert top_ids == raw[j].topk(K).indices.tolist()
    assert max(logprob for _, logprob, *_ in rows) < -1  # far from the biased distribution's ~0
