"""Structured output requested the ways OpenAI and vLLM spell it, read into one StructuredOutput.

- OpenAI: `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}} ("text" is free text);
- vLLM: `structured_outputs` {json | regex | choice | grammar | json_object, disable_any_whitespace}
  and its older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one constraint per request. Shapes are checked here (400 naming the field); whether a
schema, regex or grammar parses is checked when the engine admits the request (lanes/sample/grammar.py),
which answers the same way.
"""

import json
from typing import Any

from lanes.sample.params import ParamError, StructuredOutput

# vLLM's structured_outputs keys served here (disable_fallback and disable_additional_properties change
# nothing: xgrammar is the only backend, and its schemas are strict already), and those refused by name.
_SERVED_KEYS = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace", "disable_fallback",
                "disable_additional_properties"}
_REFUSED_KEYS = {"structural_tag": "structural tags are not served",
                 "whitespace_pattern": "a whitespace pattern is not served (disable_any_whitespace is)"}


def structured_output(response_format: dict | None, structured_outputs: dict | None,
                      guided: dict[str, Any]) -> StructuredOutput | None:
    """`guided`: the request's guided_json, guided_regex, guided_choice, guided_grammar (None when unset)."""
    found = [spec for spec in (_response_format(response_format), _structured_outputs(structured_outputs),
                               *(_guided(name, value) for name, value in guided.items())) if spec is not None]
    if len(found) > 1:
        raise ParamError(found[1].field, f"one structured output constraint per request; {found[0].field} is "
                                         "already set")
    return found[0] if found else None


def _response_format(fmt: dict | None) -> StructuredOutput | None:
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", "", "response_format")
    if kind != "json_schema":
        raise ParamError("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    body = fmt.get("json_schema")
    if not isinstance(body, dict):
        raise ParamError("response_format.json_schema", "an object with `name` and `schema` is required")
    schema = body.get("schema", body.get("json_schema"))  # vLLM also reads the key under its field name
    if schema is None:
        raise ParamError("response_format.json_schema.schema", "a JSON schema is required")
    return StructuredOutput("json", _schema_text(schema, "response_format.json_schema.schema"), "response_format")


def _structured_outputs(so: dict | None) -> StructuredOutput | None:
    if not so:
        return None
    for key in so:
        if key in _REFUSED_KEYS and so[key] is not None:
            raise ParamError(f"structured_outputs.{key}", _REFUSED_KEYS[key])
        if key not in _SERVED_KEYS and key not in _REFUSED_KEYS:
            raise ParamError(f"structured_outputs.{key}", "is not a structured_outputs field")
    constraints = [k for k in ("json", "regex", "choice", "grammar") if so.get(k) is not None]
    constraints += ["json_object"] if so.get("json_object") else []
    if len(constraints) != 1:
        raise ParamError("structured_outputs", f"exactly one of json, regex, choice, grammar, json_object must be set, "
                                               f"got {constraints or 'none'}")
    whitespace = so.get("disable_any_whitespace") is False  # compact unless asked (lanes/sample/grammar.py says why)
    kind = constraints[0]
    if kind == "json_object":
        return StructuredOutput("json_object", "", "structured_outputs.json_object", whitespace)
    return _guided(f"guided_{kind}", so[kind], f"structured_outputs.{kind}", whitespace)


def _guided(name: str, value: Any, field: str | None = None, any_whitespace: bool = False) -> StructuredOutput | None:
    if value is None:
        return None
    field = field or name
    kind = name.removeprefix("guided_")
    if kind == "json":
        return StructuredOutput("json", _schema_text(value, field), field, any_whitespace)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ParamError(field, "must be a non-empty list of non-empty strings")
        return StructuredOutput("choice", json.dumps(value), field)
    if not isinstance(value, str) or not value:
        raise ParamError(field, "must be a non-empty string")
    return StructuredOutput(kind, value, field)


def _schema_text(schema: Any, field: str) -> str:
    """A schema as JSON text (the cache key): a dict is dumped in its own key order, a string must parse."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ParamError(field, f"is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ParamError(field, f"must be a JSON schema (an object), got {type(schema).__name__}")
    return json.dumps(schema)
