"""Real clients, as their users run them, against a real Serve instance of the shipped pair (models/,
unified and pdv, CPU): the `openai` SDK through its typed arguments, lm-eval's `local-completions` (its
log-likelihoods equal those of the target loaded by transformers, within 1e-4; its generations equal the
target's greedy output), langchain-openai's streaming `ChatOpenAI`, and aiperf's streamed chat and
completions profiles with 0 errors. The clients are pinned in requirements-test.txt; aiperf, whose pins
conflict with requirements.txt, lives in .venv-aiperf (requirements-aiperf.txt), and lm-eval, whose
dependencies (scikit-learn among them) transformers would import in every replica, in .venv-lmeval
(requirements-lmeval.txt): both run as their CLIs. `bash scripts/setup.sh --test` installs all three."""

import inspect
import json
import os
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from deployments.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from lanes.model.loader import load_model
from lanes.sample.params import ParamError
from tests.engine_helpers import hf_greedy
from tests.serve_helpers import HTTP_PORT, MODEL, app_config, base_url, openai_client, serving, wait_until_idle

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[1]
TARGET_DIR = REPO / "models" / "vpd-target"
DRAFT_DIR = REPO / "models" / "vpd-draft"
TASKS_DIR = REPO / "tests" / "lm_eval_tasks"
AIPERF = Path(os.environ.get("VPD_AIPERF", REPO / ".venv-aiperf" / "bin" / "aiperf"))
LM_EVAL = Path(os.environ.get("VPD_LM_EVAL", REPO / ".venv-lmeval" / "bin" / "lm-eval"))
APP = "unified"
PDV = "pdv"  # the three lanes (one replica each)
ENGINE = {"max_model_len": 512, "max_num_seqs": 8, "num_speculative_tokens": 4, "prefill_chunk_tokens": 64}
PROMPTS = ["def parse_args(argv=None):\n", "class LRUCache:\n    def __init__(self, capacity):\n"]
CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "developer", "content": "Answer with code only."},
        {"role": "user", "content": [{"type": "text", "text": "A function that"},
                                     {"type": "text", "text": "adds two numbers."}]}]


@pytest.fixture(scope="module", autouse=True)
def app():
    one_replica = {"num_cpus": 0.05, "num_replicas": 1}
    with serving({mode: app_config(mode, str(TARGET_DIR), str(DRAFT_DIR), engine=ENGINE, decode_lane=one_replica)
                  for mode in (APP, PDV)}):
        yield


@pytest.fixture(scope="module")
def target():
    """The shipped target as transformers loads it (`AutoModelForCausalLM`, sdpa), with its tokenizer, in
    the dtype the app serves it in (float32)."""
    return load_model(str(TARGET_DIR))


@pytest.fixture(scope="module")
def tokenizer(target):
    return target.tokenizer


# ---- the openai SDK --------------------------------------------------------------------------------

# Every typed argument of the pinned SDK's `create`, with a value a client sends: served (or accepted, where
# it changes nothing about the output) ...
SDK_COMPLETION = dict(model=MODEL, prompt="x", best_of=1, echo=True, frequency_penalty=0.1, logit_bias={"5": 1},
                      logprobs=1, max_tokens=4, n=2, presence_penalty=0.1, seed=1, stop=["\n"], stream=True,
                      stream_options={"include_usage": True}, suffix=None, temperature=0.5, top_p=0.9, user="u")
SDK_CHAT = dict(messages=CHAT, model=MODEL, frequency_penalty=0.1, logit_bias={"5": 1}, logprobs=True,
                max_completion_tokens=4, max_tokens=4, metadata={"k": "v"}, modalities=["text"], n=2,
                parallel_tool_calls=False, presence_penalty=0.1, prompt_cache_key="k",
                prompt_cache_options={"mode": "implicit"}, prompt_cache_retention="in_memory",
                response_format={"type": "json_object"}, safety_identifier="s", seed=1, service_tier="auto",
                stop=["\n"], store=False, stream=True,
                stream_options={"include_usage": True, "include_obfuscation": False},
                temperature=0.5, tool_choice="none", top_logprobs=2, top_p=0.9, user="u", verbosity="medium")
# ... or refused with a 400 naming them.
SDK_COMPLETION_REFUSED = dict(best_of=2, suffix="\n")
SDK_CHAT_REFUSED = dict(audio={"voice": "alloy", "format": "wav"}, function_call={"name": "f"},
                        functions=[{"name": "f"}], moderation={"model": "omni-moderation-latest"},
                        prediction={"type": "content", "content": "x"}, reasoning_effort="low",
                        tools=[{"type": "function", "function": {"name": "f"}}], verbosity="low",
                        web_search_options={"search_context_size": "low"})
SDK_TRANSPORT = {"extra_headers", "extra_query", "extra_body", "timeout"}


def sdk_body(create, **kwargs) -> dict:
    """The JSON body the SDK sends for these typed arguments (captured, never sent)."""
    sent = []

    def capture(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(418, json={"error": {"message": "captured"}})

    client = openai.OpenAI(base_url="http://sdk.invalid/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(capture)))
    with pytest.raises(openai.APIStatusError):
        create(client)(**kwargs)
    return sent[0]


@pytest.mark.parametrize(("create", "schema", "served", "refused"), [
    (lambda c: c.completions.create, CompletionRequest, SDK_COMPLETION, SDK_COMPLETION_REFUSED),
    (lambda c: c.chat.completions.create, ChatCompletionRequest, SDK_CHAT, SDK_CHAT_REFUSED),
], ids=["completions", "chat"])
def test_every_typed_sdk_argument_is_served_or_refused_by_name(create, schema, served, refused):
    """No typed argument of the pinned SDK lands among the ignored unknown fields: each is served, accepted
    or refused by name. A new SDK release's argument fails here until it is classified."""
    typed = set(inspect.signature(create(openai.OpenAI(api_key="x"))).parameters) - SDK_TRANSPORT
    assert typed == served.keys() | refused.keys(), typed ^ (served.keys() | refused.keys())
    request = schema.model_validate(sdk_body(create, **served))
    assert request.ignored_fields() == []
    request.sampling_params()  # raises ParamError on anything refused
    for name, value in refused.items():
        with pytest.raises(ParamError) as err:
            schema.model_validate(sdk_body(create, **{**served, name: value})).sampling_params()
        assert err.value.field == name


def test_sdk_completions_take_every_typed_argument(tokenizer):
    """One typed call with every argument of `completions.create` the server serves, and the vLLM ones
    through extra_body: seeded samples reproduce, echo + logprobs cover prompt and output, usage adds up."""
    c = openai_client(APP)
    bias_id = tokenizer.convert_tokens_to_ids("Ġpass")
    args = dict(model=MODEL, prompt=PROMPTS, n=2, echo=True, logprobs=2, max_tokens=12, temperature=0.8, top_p=0.95,
                seed=7, stop=["\n\n\n", "@@"], presence_penalty=0.3, frequency_penalty=0.2,
                logit_bias={str(bias_id): -100}, user="real-clients", best_of=1,
                extra_body={"min_tokens": 4, "repetition_penalty": 1.1, "top_k": 50, "return_token_ids": True})
    out = c.completions.create(**args)
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    prompt_lens = [len(tokenizer.encode(p)) for p in PROMPTS]
    generated = 0
    for ch in out.choices:
        prompt, n_prompt = PROMPTS[ch.index // 2], prompt_lens[ch.index // 2]
        n_out = len(ch.token_ids)
        assert ch.text.startswith(prompt) and 4 <= n_out <= 12 and bias_id not in ch.token_ids
        lp = ch.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + n_out and lp.token_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        generated += n_out
    assert out.usage.prompt_tokens == sum(prompt_lens) and out.usage.completion_tokens == generated
    assert [ch.text for ch in c.completions.create(**args).choices] == [ch.text for ch in out.choices]
    streamed = list(c.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts = {}
    for chunk in streamed[:-1]:
        (ch,) = chunk.choices
        texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert [texts[i] for i in range(4)] == [ch.text for ch in out.choices]
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == generated
    for refused, param in [(dict(best_of=2), "best_of"), (dict(suffix="\n"), "suffix")]:
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(model=MODEL, prompt="x", max_tokens=2, **refused)
        assert err.value.body["param"] == param


def test_sdk_stop_list_ends_the_text_at_the_first_stop_string():
    """Two stop strings cut from the middle of the greedy text (so not at token boundaries): the output ends
    before the earlier one, streamed or not."""
    c = openai_client(APP)
    free = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=48, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    early, late = free[12:20], free[30:34]
    cut = min(free.index(early), free.index(late))
    args = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=48, temperature=0, stop=[late, early])
    out = c.completions.create(**args).choices[0]
    assert (out.text, out.finish_reason) == (free[:cut], "stop")
    chunks = [ch.choices[0] for ch in c.completions.create(**args, stream=True)]
    assert "".join(ch.text for ch in chunks) == free[:cut] and chunks[-1].finish_reason == "stop"


class Adder(BaseModel):
    name: str = Field(pattern="^[a-z_]{1,16}$")
    arity: int = Field(ge=0, le=9)


def test_sdk_chat_takes_every_typed_argument():
    """Chat with system, developer and content-part messages and every typed argument the server serves;
    streamed with include_usage and vLLM's continuous_usage_stats; json_object and json_schema (parse); a
    tool message."""
    c = openai_client(APP)
    args = dict(model=MODEL, messages=CHAT, n=2, max_completion_tokens=10, temperature=0.7, top_p=0.9, seed=3,
                stop=["\n\n\n"], presence_penalty=0.2, frequency_penalty=0.1, logit_bias={"0": -100}, logprobs=True,
                top_logprobs=3, user="real-clients", store=False, metadata={"suite": "real-clients"},
                service_tier="auto", parallel_tool_calls=False, tool_choice="none", modalities=["text"],
                extra_body={"min_tokens": 2, "repetition_penalty": 1.05})
    out = c.chat.completions.create(**args)
    assert [ch.index for ch in out.choices] == [0, 1]
    for ch in out.choices:
        content = ch.logprobs.content
        assert ch.message.role == "assistant" and 2 <= len(content) <= 10
        assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)
    assert out.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in out.choices)
    streamed = list(c.chat.completions.create(**args, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))  # vLLM's key beside OpenAI's typed one
    texts = {}
    for chunk in streamed[:-1]:
        (ch,) = chunk.choices
        texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
        assert chunk.usage is not None and chunk.usage.prompt_tokens == out.usage.prompt_tokens
    assert [texts[0], texts[1]] == [ch.message.content for ch in out.choices]
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == out.usage.completion_tokens
    # Greedy, the shipped pair (trained on Python) repeats one key forever; a frequency penalty ends it.
    obj = c.chat.completions.create(model=MODEL, messages=CHAT, response_format={"type": "json_object"},
                                    max_completion_tokens=128, temperature=0, frequency_penalty=2.0)
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    parsed = c.chat.completions.parse(model=MODEL, messages=CHAT, response_format=Adder, max_completion_tokens=64,
                                      temperature=0).choices[0].message.parsed
    assert isinstance(parsed, Adder)
    # The tool role, which the shipped chat template renders as any other.
    tool = c.chat.completions.create(model=MODEL, max_completion_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "add(1, 2)"},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}])
    assert tool.choices[0].message.content and tool.usage.completion_tokens <= 8


# ---- lm-eval ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[APP, PDV])
def lm_eval_run(request, tmp_path_factory):
    """lm-eval's two tasks over tests/lm_eval_tasks/python_snippets.jsonl, through `local-completions`
    with the shipped tokenizer, 4 prompts a request, against each app, run as its users run it (the CLI,
    `--log_samples`); returns each task's samples as lm-eval wrote them."""
    assert LM_EVAL.exists(), f"{LM_EVAL} missing: bash scripts/setup.sh --test installs it"
    out = tmp_path_factory.mktemp(f"lm_eval_{request.param}")
    model_args = {"model": MODEL, "base_url": f"{base_url(request.param)}/completions",
                  "tokenizer_backend": "huggingface", "tokenizer": str(TARGET_DIR), "max_retries": 1}
    cmd = [str(LM_EVAL), "run", "--model", "local-completions",
           "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()), "--batch_size", "4",
           "--tasks", "vpd_python_loglik,vpd_python_generate", "--include_path", str(TASKS_DIR),
           "--log_samples", "--output_path", str(out)]
    # The task YAMLs name their JSONL from the repository root, as `lm_eval --include_path` does.
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = {}
    for task in ("vpd_python_loglik", "vpd_python_generate"):
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return samples


def _arguments(sample: dict) -> list:
    """A logged sample's request arguments, in order (lm-eval logs them as gen_args_0: {arg_0, arg_1})."""
    args = sample["arguments"]["gen_args_0"]
    return [args[f"arg_{i}"] for i in range(len(args))]


def lm_eval_split(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The tokens lm-eval scores for a pair (`_encode_pair`, causal): the context's trailing spaces move to
    the continuation; the context is encoded alone, and the continuation is what follows as many tokens in
    the encoding of the whole. (Where a token of the whole spans the boundary, such as `({` in the last
    snippet, the sequence sent is not the text's own encoding; lm-eval scores it all the same.)"""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


def test_lm_eval_loglikelihoods_equal_the_targets_in_transformers(lm_eval_run, tokenizer, target):
    samples = lm_eval_run["vpd_python_loglik"]
    assert len(samples) == 8
    deltas = []
    for sample in samples:
        # Logged as strings (lm-eval's sanitize_list): str() of a float round-trips exactly.
        loglik, is_greedy = float(sample["resps"][0][0][0]), sample["resps"][0][0][1] == "True"
        context_ids, continuation_ids = lm_eval_split(tokenizer, *_arguments(sample))
        ids = torch.tensor([context_ids + continuation_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(target.model(ids).logits[0].double(), dim=-1)[len(context_ids) - 1:-1]
        expected = logprobs.gather(1, torch.tensor(continuation_ids)[:, None]).sum().item()
        deltas.append(abs(loglik - expected))
        assert is_greedy == bool((logprobs.argmax(-1) == torch.tensor(continuation_ids)).all())
    print(f"lm-eval against transformers ({len(deltas)} pairs): max |delta loglik| = {max(deltas):.2e}")
    assert max(deltas) < 1e-4, deltas


def test_lm_eval_generate_until_equals_the_targets_greedy_text(lm_eval_run, tokenizer, target):
    samples = lm_eval_run["vpd_python_generate"]
    assert len(samples) == 8
    for sample in samples:
        context, gen_kwargs = _arguments(sample)
        ids = hf_greedy(target, tokenizer.encode(context, add_special_tokens=False), gen_kwargs["max_gen_toks"])
        if tokenizer.eos_token_id in ids:  # the served request ends there (no ignore_eos)
            ids = ids[:ids.index(tokenizer.eos_token_id)]
        expected = tokenizer.decode(ids, skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == expected


# ---- langchain-openai --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [APP, PDV])
def test_langchain_chat_openai_streams_the_same_text_as_the_sdk(mode):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=base_url(mode), api_key="unused", temperature=0, max_tokens=24,
                     streaming=True, stream_usage=True, max_retries=0)
    messages = [SystemMessage("You write Python."), HumanMessage("A function that adds two numbers.")]
    chunks = list(llm.stream(messages))
    assert len(chunks) > 2
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    ref = openai_client(mode).chat.completions.create(
        model=MODEL, temperature=0, max_completion_tokens=24,
        messages=[{"role": "system", "content": "You write Python."},
                  {"role": "user", "content": "A function that adds two numbers."}])
    assert merged.content == ref.choices[0].message.content
    assert merged.response_metadata["finish_reason"] == ref.choices[0].finish_reason
    assert merged.usage_metadata["input_tokens"] == ref.usage.prompt_tokens
    assert merged.usage_metadata["output_tokens"] == ref.usage.completion_tokens


# ---- aiperf ------------------------------------------------------------------------------------------

REQUESTS, OSL = 12, 16


@pytest.mark.parametrize(("endpoint", "mode"), [("chat", PDV), ("completions", APP)])
def test_aiperf_profiles_streams_with_no_errors(endpoint, mode, tmp_path):
    """A short concurrent profile of synthetic prompts, as aiperf sends them: max_completion_tokens (chat),
    stream_options.include_usage, and on chat vLLM's continuous_usage_stats (--per-chunk-usage)."""
    assert AIPERF.exists(), f"{AIPERF} missing: bash scripts/setup.sh --test installs it"
    per_chunk = ["--per-chunk-usage", "--use-server-token-count"] if endpoint == "chat" else []
    cmd = [str(AIPERF), "profile", "--model", MODEL, "--url", f"http://127.0.0.1:{HTTP_PORT}/{mode}",
           "--endpoint-type", endpoint, "--streaming", *per_chunk, "--tokenizer", str(TARGET_DIR),
           "--request-count", str(REQUESTS), "--concurrency", "4", "--isl", "32", "--osl", str(OSL),
           "--extra-inputs", "ignore_eos:true", "--random-seed", "1", "--artifact-dir", str(tmp_path),
           "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry"]
    # aiperf 0.13's offline mode looks for the tokenizer in the hub's cache only, refusing a local directory;
    # a local path loads with no network access either way.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["AIPERF_DATASET_MMAP_BASE_PATH"] = str(tmp_path)  # not the system's temp dir, where aiperf leaves it behind
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [] and summary["request_error_rate"]["avg"] == 0
    assert summary["request_count"]["avg"] == summary["completed_request_count"]["avg"] == REQUESTS
    records = [json.loads(line) for line in (tmp_path / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == REQUESTS and not any(r.get("error") for r in records)
    # ignore_eos: every stream ran to max tokens, and its final usage says so
    assert all(r["metrics"]["usage_completion_tokens"]["value"] == OSL for r in records)
    wait_until_idle(mode, mode)
