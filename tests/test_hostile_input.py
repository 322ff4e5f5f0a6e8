"""Access and hostile input on a real Serve instance (CPU, tiny pair): the API key guards every route
but /health, and no request body, however malformed or extreme, gets a 5xx or anything but an
OpenAI-shaped error naming what is wrong."""

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from deployments.api.ingress import API_KEY_ENV, authorized, resolve_api_key
from schemathesis import GenerationMode

from tests.serve_helpers import MODEL, app_config, base_url, openai_client, serving, wait_until_idle

pytestmark = pytest.mark.serve(shared_apps=True)  # its apps stay for the next such module (serve_helpers.serving)

KEY = "sk-test-0123456789"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module", autouse=True)
def apps(pair_paths):
    target, draft = pair_paths
    with serving({"keyed": app_config("unified", target, draft, api_key=KEY),
            "pdv": app_config("pdv", target, draft)}, shared=True):
        yield


def root(app: str) -> str:
    return base_url(app).removesuffix("/v1")


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    assert error["code"] == status
    if param is not None:
        assert error["param"].split(".")[0] == param and param in error["message"], error
    return error


# ---- the API key ------------------------------------------------------------------------------


def keyed_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, read from its own OpenAPI schema, and the schema's
    and docs' routes: a route added later is covered without editing this test."""
    schema = httpx.get(f"{root('keyed')}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert schema.status_code == 200, schema.text
    routes = [(m.upper(), path) for path, ops in schema.json()["paths"].items() for m in ops]
    assert ("POST", "/v1/completions") in routes and ("GET", "/health") in routes
    return routes + [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/no/such/route")]


BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/tokenize": {"prompt": "x"}, "/v1/tokenize": {"prompt": "x"},
    "/detokenize": {"tokens": [1]}, "/v1/detokenize": {"tokens": [1]},
}


def test_every_route_but_health_answers_401_without_the_right_key():
    for method, path in keyed_routes():
        if path == "/health":
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
            r = httpx.request(method, f"{root('keyed')}{path}", json=BODIES.get(path), headers=headers, timeout=30)
            error = assert_openai_error(r, 401)
            assert error["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"


def test_the_right_key_opens_every_route_and_health_needs_none():
    assert httpx.get(f"{root('keyed')}/health", timeout=30).status_code == 200
    for method, path in keyed_routes():
        if path == "/no/such/route":
            continue
        r = httpx.request(method, f"{root('keyed')}{path}", json=BODIES.get(path),
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        # The controller is disabled in this app: its route answers 404 once past the key.
        assert r.status_code == (404 if path == "/v1/controller" else 200), (path, r.text)


def test_openai_sdk_passes_its_api_key():
    ok = openai_client("keyed", KEY)
    done = ok.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=5, temperature=0)
    assert done.usage.completion_tokens == 5
    chat = list(ok.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, stream=True))
    assert chat[-1].choices[0].finish_reason is not None
    with pytest.raises(openai.AuthenticationError) as exc:
        openai_client("keyed", "wrong").models.list()
    assert exc.value.status_code == 401 and exc.value.body["type"] == "authentication_error"


def test_config_key_wins_over_the_environment_and_comparison_is_exact():
    assert resolve_api_key("from-config", {API_KEY_ENV: "from-env"}) == b"from-config"
    assert resolve_api_key(None, {API_KEY_ENV: "from-env"}) == b"from-env"
    assert resolve_api_key(None, {}) is None and resolve_api_key(None, {API_KEY_ENV: ""}) is None
    assert authorized("Bearer k1", b"k1") and authorized("bearer  k1 ", b"k1")
    assert not authorized("Bearer k", b"k1") and not authorized("Bearer k1k", b"k1") and not authorized(None, b"k1")
    assert not authorized("Bearer ключ", b"k1")  # non-ASCII headers are compared, not crashed on


# ---- hostile input ----------------------------------------------------------------------------

COMPLETION = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MB = 1 << 20
# (case, path, body: a dict sent as JSON or raw bytes, expected status, the field a 4xx must name)
HOSTILE = [
    ("huge max_tokens", "completions", {**COMPLETION, "max_tokens": 10**9}, 400, "max_tokens"),
    ("max_tokens past int64", "completions", {**COMPLETION, "max_tokens": 10**30}, 400, "max_tokens"),
    ("negative max_tokens", "completions", {**COMPLETION, "max_tokens": -1}, 400, "max_tokens"),
    ("huge max_completion_tokens", "chat/completions", {**CHAT, "max_completion_tokens": 10**9}, 400, "max_tokens"),
    ("n 2", "completions", {**COMPLETION, "n": 2}, 200, None),
    ("n 3, chat", "chat/completions", {**CHAT, "n": 3}, 200, None),
    ("n 16", "completions", {**COMPLETION, "n": 16}, 200, None),
    ("n 17", "completions", {**COMPLETION, "n": 17}, 400, "n"),
    ("n 17, chat", "chat/completions", {**CHAT, "n": 17}, 400, "n"),
    ("n = 0", "completions", {**COMPLETION, "n": 0}, 400, "n"),
    ("n past int64", "completions", {**COMPLETION, "n": 10**30}, 400, "n"),
    ("a batch of 300 prompts (past max_queued_requests)", "completions", {**COMPLETION, "prompt": ["x"] * 300},
     400, "prompt"),
    ("a batch of 4 prompts times n 16", "completions", {**COMPLETION, "prompt": ["x"] * 4, "n": 16}, 200, None),
    ("an empty prompt in a batch", "completions", {**COMPLETION, "prompt": ["x", ""]}, 400, "prompt"),
    # Logprobs are served in pdv too (the prefill lane returns the first token's); bounds are refused by name.
    ("logprobs 5", "completions", {**COMPLETION, "logprobs": 5}, 200, None),
    ("logprobs 21", "completions", {**COMPLETION, "logprobs": 21}, 400, "logprobs"),
    ("logprobs past int64", "completions", {**COMPLETION, "logprobs": 10**30}, 400, "logprobs"),
    ("logprobs -1", "completions", {**COMPLETION, "logprobs": -1}, 400, "logprobs"),
    ("logprobs and top_logprobs 20, chat", "chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 20}, 200,
     None),
    ("echo of token ids outside the vocabulary", "completions", {**COMPLETION, "prompt": [-5, 3], "echo": True}, 400,
     "prompt"),
    ("top_logprobs 21, chat", "chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("top_logprobs without logprobs, chat", "chat/completions", {**CHAT, "top_logprobs": 5}, 400, "top_logprobs"),
    ("stop: 100 strings", "completions", {**COMPLETION, "stop": [f"never-{i}" for i in range(100)]}, 200, None),
    ("stop: 100 strings, chat", "chat/completions", {**CHAT, "stop": [f"no{i}" for i in range(100)]}, 200, None),
    ("1 MB prompt", "completions", {**COMPLETION, "prompt": "x = 1\n" * (MB // 6)}, 400, "prompt"),
    ("1 MB prompt of one character", "completions", {**COMPLETION, "prompt": "a" * MB}, 400, "prompt"),
    ("1 MB chat message", "chat/completions", {**CHAT, "messages": [{"role": "user", "content": "y" * MB}]}, 400,
     "messages"),
    ("temperature 1e-45 (raised to 0.01, as vLLM does)", "chat/completions", {**CHAT, "temperature": 1e-45}, 200,
     None),
    ("1 MB of token ids", "completions", {**COMPLETION, "prompt": [1] * (MB // 3)}, 400, "prompt"),
    ("invalid UTF-8", "completions", b'{"model": "vpd-python", "prompt": "\xff\xfe\xfa"}', 400, None),
    ("invalid UTF-8 in a key", "completions", b'{"model": "vpd-python", "\xc3\x28": 1, "prompt": "x"}', 400, None),
    ("nested 10,000 deep in a field", "completions",
     f'{{"model": "vpd-python", "prompt": "x", "metadata": {"[" * 10_000}{"]" * 10_000}}}'.encode(), 400, None),
    ("nested 10,000 deep", "chat/completions", ("[" * 10_000 + "]" * 10_000).encode(), 400, None),
    ("nested objects 10,000 deep", "completions", ('{"a": ' * 10_000 + "1" + "}" * 10_000).encode(), 400, None),
    ("a JSON array body", "completions", b"[1, 2]", 422, None),
    ("temperature -0.1", "completions", {**COMPLETION, "temperature": -0.1}, 400, "temperature"),
    ("temperature NaN", "completions", b'{"model": "vpd-python", "prompt": "x", "temperature": NaN}', 400,
     "temperature"),
    ("temperature 0", "completions", {**COMPLETION, "temperature": 0}, 200, None),
    ("temperature 1e-30", "completions", {**COMPLETION, "temperature": 1e-30}, 200, None),
    ("temperature 1e-45", "completions", {**COMPLETION, "temperature": 1e-45}, 200, None),
    ("temperature 2", "completions", {**COMPLETION, "temperature": 2}, 200, None),
    ("temperature 2.5", "completions", {**COMPLETION, "temperature": 2.5}, 200, None),
    ("temperature 1e300", "completions", {**COMPLETION, "temperature": 1e300}, 200, None),
    ("temperature Infinity", "completions", b'{"model": "vpd-python", "prompt": "x", "temperature": Infinity}',
     400, "temperature"),
    ("top_p 0", "completions", {**COMPLETION, "top_p": 0}, 400, "top_p"),
    ("top_p -0.5", "completions", {**COMPLETION, "top_p": -0.5}, 400, "top_p"),
    ("top_p 1e-9", "completions", {**COMPLETION, "top_p": 1e-9, "temperature": 1}, 200, None),
    ("top_p 1", "completions", {**COMPLETION, "top_p": 1}, 200, None),
    ("top_p 1.0001", "completions", {**COMPLETION, "top_p": 1.0001}, 400, "top_p"),
    ("min_p 0.1", "completions", {**COMPLETION, "min_p": 0.1, "temperature": 1}, 200, None),
    ("min_p 1.5", "completions", {**COMPLETION, "min_p": 1.5}, 400, "min_p"),
    ("min_p -0.1", "chat/completions", {**CHAT, "min_p": -0.1}, 400, "min_p"),
    ("top_k -1 (vLLM's 'off')", "completions", {**COMPLETION, "top_k": -1}, 200, None),
    ("top_k -2", "completions", {**COMPLETION, "top_k": -2}, 400, "top_k"),
    ("top_k 0", "completions", {**COMPLETION, "top_k": 0}, 200, None),
    ("top_k 1", "completions", {**COMPLETION, "top_k": 1, "temperature": 1}, 200, None),
    ("top_k past the vocabulary", "completions", {**COMPLETION, "top_k": 10**6, "temperature": 1}, 200, None),
    ("top_k past int64", "completions", {**COMPLETION, "top_k": 10**30, "temperature": 1}, 400, "top_k"),
    ("seed past int64", "completions", {**COMPLETION, "seed": 2**64, "temperature": 1}, 400, "seed"),
    ("negative seed", "completions", {**COMPLETION, "seed": -(2**63), "temperature": 1}, 200, None),
    ("stop_token_ids past int64", "completions", {**COMPLETION, "stop_token_ids": [10**30]}, 400, "stop_token_ids"),
    ("stop_token_ids past the vocabulary", "completions", {**COMPLETION, "stop_token_ids": [10**6]}, 400,
     "stop_token_ids"),
    ("presence_penalty 2.01", "completions", {**COMPLETION, "presence_penalty": 2.01}, 400, "presence_penalty"),
    ("frequency_penalty -2", "chat/completions", {**CHAT, "frequency_penalty": -2}, 200, None),
    ("frequency_penalty NaN", "completions",
     b'{"model": "vpd-python", "prompt": "x", "frequency_penalty": NaN}', 400, "frequency_penalty"),
    ("repetition_penalty -1", "completions", {**COMPLETION, "repetition_penalty": -1}, 400, "repetition_penalty"),
    ("repetition_penalty 1e300", "completions", {**COMPLETION, "repetition_penalty": 1e300}, 200, None),
    ("logit_bias 1e300 (clamped to 100)", "completions", {**COMPLETION, "logit_bias": {"5": 1e300}}, 200, None),
    ("logit_bias Infinity", "completions",
     b'{"model": "vpd-python", "prompt": "x", "logit_bias": {"5": Infinity}}', 400, "logit_bias"),
    ("logit_bias id -1", "completions", {**COMPLETION, "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ("logit_bias id past int64", "completions", {**COMPLETION, "logit_bias": {str(10**30): 1}}, 400, "logit_bias"),
    ("logit_bias with every id", "completions", {**COMPLETION, "logit_bias": {str(i): -1 for i in range(300)}}, 200,
     None),
    ("min_tokens -1", "completions", {**COMPLETION, "min_tokens": -1}, 400, "min_tokens"),
    ("min_tokens past max_tokens", "chat/completions", {**CHAT, "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("prompt ids past int64", "completions", {**COMPLETION, "prompt": [10**30]}, 400, "prompt"),
    ("an unknown field with a non-ASCII name", "completions", {**COMPLETION, "ключ\u00a0": 1}, 200, None),
    ("2,000 unknown fields", "completions", {**COMPLETION, **{f"f{i}": i for i in range(2000)}}, 200, None),
    ("empty prompt", "completions", {**COMPLETION, "prompt": ""}, 400, "prompt"),
    ("empty stop string", "completions", {**COMPLETION, "stop": [""]}, 400, "stop"),
]


@pytest.mark.parametrize(("case", "path", "body", "status", "param"), HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_input_gets_a_clean_answer(case, path, body, status, param):
    raw = body if isinstance(body, bytes) else None
    r = httpx.post(f"{base_url('pdv')}/{path}", json=None if raw else body, content=raw, timeout=60,
                   headers={"content-type": "application/json"})
    if status == 200:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    else:
        assert_openai_error(r, status, param)
    assert r.elapsed.total_seconds() < 30, case


def test_the_app_serves_normally_after_hostile_input():
    assert httpx.get(f"{root('pdv')}/health", timeout=30).status_code == 200
    r = httpx.post(f"{base_url('pdv')}/completions", json={**COMPLETION, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    wait_until_idle("pdv", "pdv")


# ---- schemathesis over the app's own OpenAPI schema -------------------------------------------

EXAMPLES = 50  # per operation and generation mode, fixed seed: 34 s on a shared 2-core CPU


def test_schemathesis_finds_no_server_error_and_every_4xx_is_openai_shaped():
    schema = schemathesis.openapi.from_url(f"{root('pdv')}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/health"}
    assert all(op.body for op in operations if op.method.upper() == "POST")  # the bodies are in the schema
    statuses, failures = [], []
    for op in operations:
        # A route without a body or parameters has no invalid request to generate.
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if op.body else (GenerationMode.POSITIVE,):
            @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = MODEL  # else almost every valid body stops at 404 (unknown model)
                response = _send(case)
                statuses.append(response.status_code)
                if response.status_code >= 500 or (400 <= response.status_code < 500 and not _openai_error(response)):
                    failures.append((op.method, op.path, case.body, response.status_code, response.text[:300]))

            run()
    assert not failures, failures[:5]
    assert statuses.count(200) >= 50 and sum(400 <= s < 500 for s in statuses) >= 50, sorted(set(statuses))
    wait_until_idle("pdv", "pdv")


def _send(case) -> httpx.Response:
    # Sent with httpx: schemathesis's own `case.call` goes through requests, whose pool manager it
    # inspects, and urllib3-future (which the pinned requirements bring) replaces that pool manager.
    kw = case.as_transport_kwargs(base_url=root("pdv"))
    unknown = set(kw) - {"method", "url", "headers", "params", "json", "data", "cookies"}
    assert not unknown, unknown
    data = kw.get("data")
    return httpx.request(kw["method"], kw["url"], headers=kw.get("headers"), params=kw.get("params"),
                         cookies=kw.get("cookies"), timeout=60, **({"json": kw["json"]} if "json" in kw else {}),
                         **({"content": data} if isinstance(data, (bytes, str)) else {"data": data} if data else {}))


def _openai_error(response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and error["code"] == response.status_code and bool(error["message"]))
