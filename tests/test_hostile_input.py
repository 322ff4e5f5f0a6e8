"""Access and hostile input on a real Serve instance (CPU, tiny pair): the API key guards every route
but /health, and no request body, however malformed or extreme, gets a 5xx or anything but an
OpenAI-shaped error naming what is wrong."""

import httpx
import openai
import pytest
from openai import OpenAI
from ray import serve

from deployments.ingress import API_KEY_ENV, authorized, resolve_api_key
from tests.serve_helpers import app_config, base_url, deploy, start_ray, wait_until_idle
from tests.tiny_pair import save_tiny_pair

MODEL = "vpd-python"
KEY = "sk-test-0123456789"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module", autouse=True)
def apps(tmp_path_factory):
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    start_ray()
    deploy({"keyed": app_config("unified", target, draft, api_key=KEY),
            "pdv": app_config("pdv", target, draft)})
    yield
    serve.shutdown()
    import ray
    ray.shutdown()


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
    ok = OpenAI(base_url=base_url("keyed"), api_key=KEY, max_retries=0)
    done = ok.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=5, temperature=0)
    assert done.usage.completion_tokens == 5
    chat = list(ok.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, stream=True))
    assert chat[-1].choices[0].finish_reason is not None
    with pytest.raises(openai.AuthenticationError) as exc:
        OpenAI(base_url=base_url("keyed"), api_key="wrong", max_retries=0).models.list()
    assert exc.value.status_code == 401 and exc.value.body["type"] == "authentication_error"


def test_config_key_wins_over_the_environment_and_comparison_is_exact():
    assert resolve_api_key("from-config", {API_KEY_ENV: "from-env"}) == b"from-config"
    assert resolve_api_key(None, {API_KEY_ENV: "from-env"}) == b"from-env"
    assert resolve_api_key(None, {}) is None and resolve_api_key(None, {API_KEY_ENV: ""}) is None
    assert authorized("Bearer k1", b"k1") and authorized("bearer  k1 ", b"k1")
    assert not authorized("Bearer k", b"k1") and not authorized("Bearer k1k", b"k1") and not authorized(None, b"k1")
    assert not authorized("Bearer ключ", b"k1")  # non-ASCII headers are compared, not crashed on
