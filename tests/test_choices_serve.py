"""`n` choices and batched prompts over HTTP, through the `openai` SDK, on a real Serve instance (CPU,
tiny pair) in unified and pdv: choice indices, finish reasons, summed usage, seeded samples that
differ and reproduce, prompts answered in order, and every lane's slots freed when a client leaves."""

import json

import httpx
import pytest

from deployments.api.openai_protocol import MAX_N
from lanes.model.loader import load_model
from tests.serve_helpers import MODEL, app_config, base_url, openai_client, serving, wait_until_idle

pytestmark = pytest.mark.serve(shared_apps=True)  # its apps stay for the next such module (serve_helpers.serving)

MODES = ("unified", "pdv")
PROMPTS = ["def add(a, b):", "class Point:", "for i in range(10):"]
GREEDY = dict(model=MODEL, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module", autouse=True)
def apps(pair_paths):
    target, draft = pair_paths
    with serving({mode: app_config(mode, target, draft) for mode in MODES}, shared=True):
        yield


@pytest.fixture(scope="module")
def tokenizer(pair_paths):
    return load_model(pair_paths[0]).tokenizer


@pytest.mark.parametrize("mode", MODES)
def test_n3_completions_and_chat_have_indexed_choices_and_summed_usage(mode):
    c = openai_client(mode)
    one = c.completions.create(prompt=PROMPTS[0], **GREEDY)
    three = c.completions.create(prompt=PROMPTS[0], n=3, **GREEDY)
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert all(ch.finish_reason == "length" for ch in three.choices)
    # Greedy: every choice is the single request's answer (vLLM's n > 1 is the same).
    assert [ch.text for ch in three.choices] == [one.choices[0].text] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once, not n times
    assert three.usage.completion_tokens == 3 * 6 and three.usage.total_tokens == one.usage.prompt_tokens + 18
    chat_args = dict(messages=[{"role": "user", "content": "hi"}], **GREEDY)
    chat_one = c.chat.completions.create(**chat_args)
    chat = c.chat.completions.create(n=3, **chat_args)
    assert [ch.index for ch in chat.choices] == [0, 1, 2]
    assert [ch.message.content for ch in chat.choices] == [chat_one.choices[0].message.content] * 3
    assert all(ch.finish_reason == "length" and ch.message.role == "assistant" for ch in chat.choices)
    assert chat.usage.prompt_tokens == chat_one.usage.prompt_tokens and chat.usage.completion_tokens == 18


@pytest.mark.parametrize("mode", MODES)
def test_n3_streamed_tags_each_chunk_with_its_choice_and_ends_once(mode):
    c = openai_client(mode)
    done = c.completions.create(prompt=PROMPTS[1], n=3, **GREEDY)
    chunks = list(c.completions.create(prompt=PROMPTS[1], n=3, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY))
    texts, finishes = {}, {}
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        assert choice.index not in finishes  # nothing of a choice after its final chunk
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [ch.text for ch in done.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    assert chunks[-1].usage.prompt_tokens == done.usage.prompt_tokens
    chat = list(c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], n=2, stream=True,
                                          **GREEDY))
    roles = [ch.choices[0].index for ch in chat if ch.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]  # each choice's first delta says the role
    assert sorted(ch.choices[0].index for ch in chat if ch.choices[0].finish_reason) == [0, 1]
    # The raw stream: one [DONE], at the end.
    body = {"model": MODEL, "prompt": PROMPTS[1], "n": 3, "max_tokens": 6, "stream": True, "ignore_eos": True}
    lines = [ln for ln in httpx.post(f"{base_url(mode)}/completions", json=body, timeout=60).text.splitlines() if ln]
    assert lines.count("data: [DONE]") == 1 and lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("mode", MODES)
def test_seeded_samples_differ_and_reproduce(mode):
    c = openai_client(mode)
    args = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0, seed=1234, n=4,
                extra_body={"ignore_eos": True})
    first = [ch.text for ch in c.completions.create(**args).choices]
    again = [ch.text for ch in c.completions.create(**args).choices]
    assert first == again
    assert len(set(first)) > 1, first
    # Sample i draws with seed + i: sample 0 is the n = 1 request with the same seed.
    alone = c.completions.create(**{**args, "n": 1}).choices[0].text
    assert alone == first[0]


@pytest.mark.parametrize("mode", MODES)
def test_batched_prompts_answer_in_order_as_single_requests_do(mode, tokenizer):
    c = openai_client(mode)
    singles = [c.completions.create(prompt=p, **GREEDY) for p in PROMPTS]
    batch = c.completions.create(prompt=PROMPTS, n=2, **GREEDY)
    assert [ch.index for ch in batch.choices] == list(range(6))
    # Choice prompt_index * n + i, as OpenAI and vLLM number them.
    assert [ch.text for ch in batch.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 6 * 6
    ids = [tokenizer.encode(p) for p in PROMPTS]
    by_ids = c.completions.create(prompt=ids, **GREEDY)
    assert [ch.text for ch in by_ids.choices] == [s.choices[0].text for s in singles]
    echoed = c.completions.create(prompt=ids, echo=True, **GREEDY)
    assert [ch.text for ch in echoed.choices] == [p + s.choices[0].text for p, s in zip(PROMPTS, singles)]


def test_batched_prompts_keep_echo_logprobs_per_choice(tokenizer):
    """Logprobs are served in unified (pdv refuses them by name): each choice has its own prompt's."""
    c = openai_client("unified")
    out = c.completions.create(prompt=PROMPTS, n=2, echo=True, logprobs=2, **GREEDY)
    for ch in out.choices:
        prompt = PROMPTS[ch.index // 2]
        lp = ch.logprobs
        assert ch.text.startswith(prompt) and lp.token_logprobs[0] is None
        assert len(lp.tokens) == len(tokenizer.encode(prompt)) + 6
        assert lp.text_offset[0] == 0 and lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert out.choices[0].logprobs.token_logprobs == out.choices[1].logprobs.token_logprobs


@pytest.mark.parametrize("mode", MODES)
def test_cancelled_n4_stream_frees_every_lanes_slots(mode):
    body = {"model": MODEL, "prompt": "class Point:", "n": 4, "max_tokens": 200, "stream": True, "ignore_eos": True}
    seen = set()
    with httpx.stream("POST", f"{base_url(mode)}/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.update(ch["index"] for ch in json.loads(line[6:])["choices"])
            if len(seen) == 4:
                break  # every choice has started; the client goes away mid-stream
    assert wait_until_idle(mode, mode, timeout_s=20)


@pytest.mark.parametrize("mode", MODES)
def test_a_client_gone_before_the_first_chunk_frees_every_lanes_slots(mode):
    """Gone while the prompts are prefilled (in pdv, in the prefill lane, which writes them into verify
    slots): the replies of the aborted requests must still be taken in and their slots freed."""
    body = {"model": MODEL, "prompt": "x = 1\n" * 30, "n": 4, "max_tokens": 50, "stream": True, "ignore_eos": True}
    for wait_s in (0.05, 0.2, 0.5):  # the client waits this long for headers (or a chunk), then leaves
        try:
            httpx.post(f"{base_url(mode)}/completions", json=body, timeout=wait_s)
        except httpx.TimeoutException:
            pass
    assert wait_until_idle(mode, mode, timeout_s=20)


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_prompt_in_a_batch_refuses_the_request_and_aborts_the_rest(mode):
    body = {"model": MODEL, "prompt": ["class Point:", "x = 1\n" * 400], "n": 2, "max_tokens": 50,
            "ignore_eos": True}
    r = httpx.post(f"{base_url(mode)}/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert wait_until_idle(mode, mode, timeout_s=20)


@pytest.mark.parametrize(("n", "path"), [(MAX_N + 1, "completions"), (0, "completions"),
                                         (MAX_N + 1, "chat/completions")])
def test_n_out_of_range_is_a_400_naming_n(n, path):
    body = {"model": MODEL, "n": n, **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                                         else {"prompt": "x"})}
    r = httpx.post(f"{base_url('pdv')}/{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "n" and "n" in error["message"]
