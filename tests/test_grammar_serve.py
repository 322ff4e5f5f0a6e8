"""Structured output over HTTP through the `openai` SDK's typed arguments, on a real Serve instance
(CPU, tiny pair) in nospec, unified, pd and pdv: output parses and matches, greedy output is the same in
every mode (the mask travels to pdv's prefill and verify lanes), and bad constraints get a 400
naming their field."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.serve_helpers import MODEL, app_config, base_url, openai_client, serving, wait_until_idle

pytestmark = pytest.mark.serve(shared_apps=True)  # its apps stay for the next such module (serve_helpers.serving)

MODES = ("nospec", "unified", "pd", "pdv")
# A pattern bounds the random-weight model's strings. (With maxLength instead, sampling from it once drew
# the UTF-8 bytes of a surrogate code point, which xgrammar counts as one character and Python as three.)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z0-9 _]{1,12}$"},
                                           "ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
          "required": ["name", "ok", "kind"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "describe a thing"}]


class Point(BaseModel):
    x: int = Field(ge=-99, le=99)
    label: str = Field(max_length=8)


@pytest.fixture(scope="module", autouse=True)
def apps(pair_paths):
    target, draft = pair_paths
    with serving({mode: app_config(mode, target, draft) for mode in MODES}, shared=True):
        yield


def schema_chat(mode: str, **kw):
    kw = {"max_tokens": 200, "temperature": 0, **kw}
    return openai_client(mode).chat.completions.create(model=MODEL, messages=MESSAGES, response_format=JSON_SCHEMA,
                                                       **kw)


def test_json_schema_greedy_is_the_same_in_every_mode_and_matches():
    texts = {}
    for mode in MODES:
        out = schema_chat(mode)
        assert out.choices[0].finish_reason == "stop"
        texts[mode] = out.choices[0].message.content
        jsonschema.validate(json.loads(texts[mode]), SCHEMA)
    assert len(set(texts.values())) == 1, texts
    streamed = openai_client("pdv").chat.completions.create(model=MODEL, messages=MESSAGES,
                                                            response_format=JSON_SCHEMA, max_tokens=200, temperature=0,
                                                            stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == texts["nospec"]


@pytest.mark.parametrize("mode", ["unified", "pdv"])
def test_the_sdks_typed_parse_json_object_and_vllm_fields(mode):
    c = openai_client(mode)
    parsed = c.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Point, max_tokens=120,
                                      temperature=0).choices[0].message.parsed
    assert isinstance(parsed, Point) and -99 <= parsed.x <= 99
    obj = c.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                    max_tokens=200, temperature=0)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    regex = c.completions.create(model=MODEL, prompt="x = ", max_tokens=30, temperature=0,
                                 extra_body={"guided_regex": r"[0-9]{2,4}\.[0-9]"}).choices[0].text
    assert re.fullmatch(r"[0-9]{2,4}\.[0-9]", regex), regex
    choice = c.completions.create(model=MODEL, prompt="def f():", max_tokens=30, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["pass", "return 1"]}})
    assert choice.choices[0].text in ("pass", "return 1") and choice.choices[0].finish_reason == "stop"
    grammar = c.completions.create(model=MODEL, prompt="y = ", max_tokens=30, temperature=0,
                                   extra_body={"guided_grammar": 'root ::= "[" [a-c]{1,4} "]"'}).choices[0].text
    assert re.fullmatch(r"\[[a-c]{1,4}\]", grammar), grammar


def test_pdv_batches_with_and_without_grammars_together():
    """Sampled schema requests and free-text greedy ones at once over two decode replicas: the verify lane
    merges rows with masks and rows without; free text is as it is alone."""
    free = dict(model=MODEL, prompt="class Point:", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    alone = openai_client("unified").completions.create(**free).choices[0].text

    def one(i: int):
        if i % 2:
            return openai_client("pdv").completions.create(**free).choices[0].text
        out = schema_chat("pdv", temperature=1.0, seed=i, n=2)
        return [json.loads(ch.message.content) for ch in out.choices]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for i, result in enumerate(results):
        if i % 2:
            assert result == alone
        else:
            for doc in result:
                jsonschema.validate(doc, SCHEMA)
    wait_until_idle("pdv", "pdv")


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos"),
])
@pytest.mark.parametrize("mode", ["unified", "pdv"])
def test_bad_constraints_get_400_naming_the_field(mode, body, param):
    r = httpx.post(f"{base_url(mode)}/completions", timeout=30,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
