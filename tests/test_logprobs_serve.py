"""Logprobs over HTTP through the `openai` SDK: OpenAI's shapes on completions and chat, streamed and
not, echo scoring equal to HF's log_softmax, and the same logprobs where prefill runs in a lane of its
own (pd, pdv: the prefill lane's first token and prompt, the verify lane's accepted tokens)."""

import httpx
import pytest
import torch

from lanes.model.loader import load_model
from tests.serve_helpers import MODEL, app_config, base_url, openai_client, serving

pytestmark = pytest.mark.serve(shared_apps=True)  # its apps stay for the next such module (serve_helpers.serving)

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module", autouse=True)
def apps(pair_paths):
    target, draft = pair_paths
    with serving({mode: app_config(mode, target, draft) for mode in ("unified", "pd", "pdv")}, shared=True):
        yield


def test_completions_logprobs_legacy_shape_streamed_and_not():
    c = openai_client("unified")
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3,
                extra_body={"ignore_eos": True})
    done = c.completions.create(**args)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # Top 3 and the token itself; fewer where byte tokens decode to the same string (one dict key).
        assert 1 <= len(top) <= 4 and logprob <= 0
        assert max(top.values()) == logprob and top[token] == logprob  # greedy: the most likely token
    chunks = [ch for ch in c.completions.create(**args, stream=True) if ch.choices]
    assert sum((ch.choices[0].logprobs.tokens for ch in chunks), []) == lp.tokens
    streamed = sum((ch.choices[0].logprobs.token_logprobs for ch in chunks), [])
    assert max(abs(a - b) for a, b in zip(streamed, lp.token_logprobs)) < 1e-6
    assert sum((ch.choices[0].logprobs.text_offset for ch in chunks), []) == lp.text_offset


def test_echo_with_max_tokens_0_scores_the_prompt_as_hf_does(pair_paths):
    """The log-likelihood request of evaluation harnesses: echo + logprobs + max_tokens 0."""
    target = load_model(pair_paths[0])
    ids = target.tokenizer.encode(PROMPT + "\n    return a + b\n")
    out = openai_client("unified").completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == target.tokenizer.decode(ids) and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    with torch.no_grad():
        ref = torch.log_softmax(target.model(torch.tensor([ids])).logits[0].double(), dim=-1)
    expected = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:], dtype=torch.float64), expected, atol=1e-4)
    # echo with generation: the prompt's tokens, then the generated ones, in one list.
    both = openai_client("unified").completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                       logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    assert both.text.startswith(PROMPT) and both.logprobs.token_logprobs[0] is None
    assert len(both.logprobs.tokens) == len(target.tokenizer.encode(PROMPT)) + 4


def test_chat_logprobs_content_shape_streamed_and_not():
    c = openai_client("unified")
    args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
                logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    done = c.chat.completions.create(**args)
    content = done.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8")) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
    chunks = [ch for ch in c.chat.completions.create(**args, stream=True) if ch.choices]
    streamed = [e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    plain = c.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(("body", "param"), [
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
     "top_logprobs"),
])
def test_bad_logprobs_requests_are_refused_by_name(body, param):
    path = "chat/completions" if "messages" in body else "completions"
    r = httpx.post(f"{base_url('unified')}/{path}", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("mode", ["pd", "pdv"])
def test_lanes_apart_give_the_same_logprobs_as_unified(mode, pair_paths):
    """Generated tokens' logprobs (the first from the prefill lane, the rest from verification) and
    echo's prompt logprobs are the target's own, as in unified."""
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3, echo=True,
                extra_body={"ignore_eos": True})
    ref = openai_client("unified").completions.create(**args).choices[0].logprobs
    got = openai_client(mode).completions.create(**args).choices[0].logprobs
    assert got.tokens == ref.tokens and got.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(got.token_logprobs[1:], ref.token_logprobs[1:])) < 1e-4
    for top, top_ref in zip(got.top_logprobs[1:], ref.top_logprobs[1:]):
        assert top.keys() == top_ref.keys()
    # Scoring alone (max_tokens 0): the prefill lane's prompt logprobs.
    target = load_model(pair_paths[0])
    ids = target.tokenizer.encode(PROMPT + "\n    return a + b\n")
    scored = openai_client(mode).completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    with torch.no_grad():
        logp = torch.log_softmax(target.model(torch.tensor([ids])).logits[0].double(), dim=-1)
    expected = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    lp = scored.choices[0].logprobs.token_logprobs
    assert lp[0] is None and torch.allclose(torch.tensor(lp[1:], dtype=torch.float64), expected, atol=1e-4)
