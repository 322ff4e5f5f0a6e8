"""OpenAI-compatible HTTP ingress: validates input once, streams chunks as server-sent events."""

import asyncio
import dataclasses
import importlib.metadata
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import Headers
from pydantic import ValidationError
from ray import serve
from transformers import AutoTokenizer

from deployments.api.choices import Choice, interleave, sample_params, total_usage
from deployments.api.openai_logprobs import ChoiceExtras
from deployments.api.openai_protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, chat_choice, completion_choice,
    error_body, new_id, response_body, running_usage,
)
from deployments.channels.step_inbox import StepInbox
from deployments.config import AppConfig
from deployments.placement.kv_transfer import Placement
from deployments.replicas.engine_replica import GenerateError
from deployments.routing.serve_calls import own_request
from deployments.telemetry.metrics import IngressMetrics
from deployments.telemetry.timeline import TIMELINE, replica_report
from lanes.engine.outputs import RequestOutput, merge_outputs
from lanes.sample.params import ParamError
from lanes.spec.stats import SpecDecodeStats

log = logging.getLogger(__name__)
api = FastAPI(title="Verify-PD")

API_KEY_ENV = "VPD_API_KEY"  # as vLLM's VLLM_API_KEY; `api_key` in the app config wins over it
OPEN_PATHS = {"/health"}  # answered without the key: load balancers and probes call it
HEALTH_TIMEOUT_S = 5.0  # a lane that cannot answer /health within this is reported down
LANES_TIMEOUT_S = 10.0  # a decode replica's stats wait for its current step: seconds under CPU load
try:
    VERSION = importlib.metadata.version("verify-pd")  # at GET /version
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was not pip-installed
    VERSION = "unknown"


# Handlers read the raw request (so that every error has OpenAI's shape), so FastAPI cannot see their
# bodies: the schema at /openapi.json gets them from here, for clients and schemathesis.
REQUEST_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/tokenize": TokenizeRequest, "/v1/tokenize": TokenizeRequest,
                  "/detokenize": DetokenizeRequest, "/v1/detokenize": DetokenizeRequest}


def _openapi() -> dict:
    """FastAPI's schema of the routes, plus each POST route's request body."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=VERSION, routes=api.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in REQUEST_BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            ref = {"$ref": f"#/components/schemas/{model.__name__}"}
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json":
                                                                                          {"schema": ref}}}
        api.openapi_schema = schema
    return api.openapi_schema


api.openapi = _openapi


def _error(status: int, message: str, err_type: str, param: str | None = None, headers: dict | None = None):
    return JSONResponse(error_body(message, err_type, status, param), status_code=status, headers=headers)


# What a client reads of a failure inside the server: a fixed message naming the request, whose detail
# (exception, process ids, memory figures, paths) goes to this replica's log under that id and to the
# vpd_internal_errors counter, never to the client (issue 28). Errors in the client's input keep
# their text: they say which field is wrong (ParamError, answered with 400).
def internal_error(request_id: str) -> str:
    return f"internal error while generating; request {request_id} was logged"


def lane_failed(request_id: str) -> str:
    return f"the server lost a lane while generating; request {request_id} was logged; retry"


def stream_cut(request_id: str) -> str:
    return f"the stream ended before the request finished; request {request_id} was logged; retry"


def lane_load(lane: str, stats: dict) -> dict:
    """The operator's view of one replica's `stats()`: KV slots in use of the total, its queue, and its
    process (and, for the decode lane, the process that steps its engine: another one in unified)."""
    pid = {"replica_pid": stats.get("replica_pid")}
    if lane == "decode":  # the engine: requests not yet decoding wait for a slot or for their prefill
        return {**pid, "engine_pid": stats.get("pid"), "max_num_seqs": stats["max_num_seqs"],
                "running": stats["running"], "queue_depth": stats["waiting"] + stats["prefilling"], "draft_slots_used": stats["kv_slots_used"],
                "target_slots_used": stats.get("target_slots_used"),
                "prefills_in_flight": stats.get("prefills_in_flight", 0)}
    if lane == "verify":
        return {**pid, "lease": stats.get("lease"), "kv_slots_used": stats["kv_slots_used"], "kv_slots_total": stats["kv_slots_total"],
                "queue_depth": stats["pending_rows"], "slots_reclaimed": stats.get("slots_reclaimed", 0)}
    return {**pid, "queue_depth": stats["pending"], "handed_over": stats.get("handed_over")}


def resolve_api_key(configured: str | None, environ) -> bytes | None:
    """The key every route but /health requires: the config's, else the environment's, else none."""
    key = configured or environ.get(API_KEY_ENV)
    return key.encode() if key else None


def authorized(authorization: str | None, key: bytes) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time (no timing side channel on the key)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), key)


class ApiKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware), so that a client's disconnect still reaches a stream and
    cancels its request in every lane."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            key = serve.get_replica_context().servable_object.api_key
            # Serve mounts the app under its route prefix: the route is the path below root_path.
            path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
            if key is not None and path not in OPEN_PATHS and not authorized(Headers(scope=scope).get("authorization"),
                                                                            key):
                response = _error(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                  "authentication_error", headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class InternalErrorMiddleware:
    """An exception that escapes a handler before its response started is answered with an OpenAI-style
    500 and a fixed message; the traceback goes to the log under the id in that message. (Outer to
    Starlette's own handler, which would answer in plain text and leave the rest to Serve.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            error_id = new_id("err")
            log.exception("ingress: unhandled error in %s (%s)", scope.get("path"), error_id)
            _count_internal_error("ingress")
            if started:
                raise  # the response is under way: nothing else can be sent on it
            await _error(500, internal_error(error_id), "server_error")(scope, receive, send)


def _count_internal_error(kind: str) -> None:
    try:
        serve.get_replica_context().servable_object.metrics.observe_internal_error(kind)
    except Exception:  # noqa: BLE001 - outside a replica (in-process tests) there is no counter to count in
        pass


api.add_middleware(ApiKeyMiddleware)
api.add_middleware(InternalErrorMiddleware)


class Ingress:
    def __init__(self, engine, config: dict, controller=None, prefill=None, verify=None):
        self.engine = engine
        self.controller = controller  # handle of the Controller deployment, None when it is disabled
        self.lane_handles = {"decode": engine, "prefill": prefill, "verify": verify}  # for /v1/lanes
        self.cfg = AppConfig.model_validate(config)
        self.api_key = resolve_api_key(self.cfg.api_key, os.environ)  # read by ApiKeyMiddleware
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.target.path)
        self.in_flight = 0
        self._max_model_len: int | None = None  # the engine's, once it has answered (`served_max_model_len`)
        self.totals = SpecDecodeStats()  # over requests served by this ingress replica
        self.metrics = IngressMetrics(self.cfg.mode)
        # `stream_channel: step`: this replica's outputs come one message a step per decode replica
        self.inbox = (StepInbox(engine, on_merged=self.metrics.observe_stream_coalesced)
                      if self.cfg.stream_channel == "step" else None)

    async def timeline(self, start_s: float = 0.0, offset: int = 0) -> dict:
        """This replica's requests since `start_s`, one page from `offset` (deployments/telemetry/timeline.py)."""
        return replica_report("ingress", Placement.here("cpu"), start_s, offset)

    @api.get("/health")
    async def health(self):
        """Each lane's state, as the decode (or engine) replica sees it; 503 while any lane is down."""
        try:
            lanes = await asyncio.wait_for(self.engine.lane_health.remote(), HEALTH_TIMEOUT_S)
        except Exception as exc:  # the engine replica itself is gone or wedged
            lanes = {"decode" if self.cfg.mode in ("pd", "pdv") else "engine": f"unreachable ({type(exc).__name__})"}
        ok = all(state == "ok" for state in lanes.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "lanes": lanes}, status_code=200 if ok else 503)

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.cfg.model_name, "object": "model", "owned_by": "verify-pd",
                                            "max_model_len": await self.served_max_model_len(),
                                            "mode": self.cfg.mode}]}

    async def served_max_model_len(self) -> int:
        """The context the engine serves: where `max_model_len` was left unset, the longest its memory
        fits, which may be below the model's own (the config's). The config's until the engine answers."""
        if self._max_model_len is None:
            try:
                report = await asyncio.wait_for(self.engine.stats.remote(), HEALTH_TIMEOUT_S)
                self._max_model_len = report["max_model_len"]
            except Exception:  # noqa: BLE001 - the engine is starting or being replaced: ask again next time
                return self.cfg.engine.max_model_len
        return self._max_model_len

    @api.get("/v1/spec_decode/stats")
    async def spec_decode_stats(self) -> dict:
        """Spec-decode counters summed over every finished request (vLLM's definitions)."""
        return self.totals.to_dict()

    @api.get("/v1/lanes")
    async def lanes(self):
        """Every lane replica's slots in use and queue depth, as each replica reports them now."""
        lanes = {}
        for lane, handle in self.lane_handles.items():
            if handle is not None:
                try:
                    reports = await handle.broadcast("stats").results_async(timeout_s=LANES_TIMEOUT_S)
                except Exception as exc:  # a lane being replaced: say so, keep the others
                    lanes[lane] = {"error": f"{type(exc).__name__}: {exc}"}
                    continue
                lanes[lane] = {"replicas": [lane_load(lane, r) for r in reports]}
        return {"mode": self.cfg.mode, "ingress_pid": os.getpid(), "lanes": lanes}

    @api.get("/v1/controller")
    async def controller_state(self):
        """The draft-length controller's last decision and the signals behind it."""
        if self.controller is None:
            return _error(404, "the draft-length controller is disabled in this app", "not_found_error")
        return await self.controller.state.remote()

    @api.get("/version")
    async def version(self) -> dict:
        return {"version": VERSION}

    @api.post("/tokenize")
    @api.post("/v1/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's /tokenize: a prompt's token ids, or chat messages' after the chat template."""
        body, refused = await self._parse(request, TokenizeRequest)
        if refused is not None:
            return refused
        try:
            if (body.prompt is None) == (body.messages is None):
                raise ParamError("prompt", "send either prompt or messages")
            if body.messages is not None:
                ids = self._apply_template([m.for_template(i) for i, m in enumerate(body.messages)],
                                           add_generation_prompt=body.add_generation_prompt)
            else:
                ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except ParamError as exc:
            return _error(400, str(exc), "invalid_request_error", exc.field)
        response = {"count": len(ids), "max_model_len": await self.served_max_model_len(), "tokens": ids}
        if body.return_token_strs:
            response["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return response

    @api.post("/detokenize")
    @api.post("/v1/detokenize")
    async def detokenize(self, request: Request):
        body, refused = await self._parse(request, DetokenizeRequest)
        if refused is not None:
            return refused
        if any(not 0 <= t < len(self.tokenizer) for t in body.tokens):
            return _error(400, f"token ids must be in [0, {len(self.tokenizer)})", "invalid_request_error", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, ChatCompletionRequest, chat=True)

    # ---- the one path every request takes ----------------------------------------------------

    async def _parse(self, request: Request, schema):
        """(body, None), or (None, the 400/422 response) for malformed JSON or a wrongly typed field."""
        try:
            payload = await request.json()
        except ValueError as exc:  # json.JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
            return None, _error(400, f"malformed JSON: {exc}", "invalid_request_error")
        except RecursionError:  # the parser's nesting bound (~1,000 levels)
            return None, _error(400, "malformed JSON: nested too deeply", "invalid_request_error")
        try:
            body = schema.model_validate(payload)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            return None, _error(422, f"{param}: {first['msg']}", "invalid_request_error", param)
        if ignored := body.ignored_fields():
            # Accepted and ignored, as vLLM does; said once per request, and counted by name.
            log.info("%s: ignoring fields this server does not know: %s", request.url.path, ", ".join(ignored))
            self.metrics.observe_ignored_fields(ignored)
        return body, None

    async def _serve(self, request: Request, schema, chat: bool):
        received_s = time.time()  # this replica's handler began (timelines: the proxy's hop before it)
        body, refused = await self._parse(request, schema)
        if refused is not None:
            return refused
        if body.model != self.cfg.model_name:
            return _error(404, f"model {body.model!r} does not exist; this server serves {self.cfg.model_name!r}",
                          "not_found_error", "model")
        try:
            params = body.sampling_params()
            prompts = [self._chat_prompt(body)] if chat else body.prompts()
            choices = [c for j, p in enumerate(prompts) for c in self._choices(body, j, p, params, chat)]
            if len(choices) > (limit := self.cfg.max_queued_requests):  # could never be admitted
                raise ParamError("n" if len(prompts) == 1 else "prompt",
                                 f"{len(prompts)} prompt(s) x n={body.n} is {len(choices)} choices; "
                                 f"at most {limit} run at once")
        except ParamError as exc:
            return _error(400, str(exc), "invalid_request_error", exc.field)
        # Each choice is a request in the lanes, and counts as one here.
        if self.in_flight + len(choices) > self.cfg.max_queued_requests:
            return _error(429, "too many requests in flight; retry shortly", "rate_limit_error",
                          headers={"Retry-After": "1"})
        return await self._respond(body, choices, chat, received_s)

    def _choices(self, body, prompt_index: int, prompt, params, chat: bool) -> list[Choice]:
        """Prompt `prompt_index`'s n choices. Raises ParamError on echoed ids outside the vocabulary."""
        echo = not chat and body.echo
        if echo and isinstance(prompt, list) and not all(0 <= t < len(self.tokenizer) for t in prompt):
            # Checked here, not only in the engine: echo decodes the ids before the engine sees them.
            raise ParamError("prompt", f"token ids must be in [0, {len(self.tokenizer)})")
        echo_text = prompt if echo and isinstance(prompt, str) else None
        if echo_text is not None:
            prompt = self.tokenizer.encode(prompt)  # as the engine would: echo scores exactly these tokens
        return [Choice(prompt_index * body.n + i, prompt, sample,
                       ChoiceExtras(self.tokenizer, chat, params.logprobs is not None, prompt if echo else None,
                                    echo_text))
                for i, sample in enumerate(sample_params(params, body.n))]

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        ids = self._apply_template(body.template_messages(), add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message,
                                   **(body.chat_template_kwargs or {}))
        # Named here: the client sent messages. (The engine's own limit, once known, is the one it checks.)
        if len(ids) >= (limit := self._max_model_len or self.cfg.engine.max_model_len):
            raise ParamError("messages", f"{len(ids)} tokens after the chat template; the context holds {limit} "
                             "(prompt + output)")
        return ids

    def _apply_template(self, messages: list[dict], **kwargs) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ParamError("messages", "the served model has no chat template")
        if kwargs.get("continue_final_message"):
            kwargs["add_generation_prompt"] = False  # the two contradict; vLLM lets continuation win
        try:
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
        except Exception as exc:  # the template refuses a role or shape (e.g. no system role)
            raise ParamError("messages", f"the chat template refused them: {exc}") from exc
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def _respond(self, body, choices: list[Choice], chat: bool, received_s: float):
        rid = new_id("chatcmpl" if chat else "cmpl")
        self.in_flight += len(choices)
        # One choice keeps the response's id in the lanes; several are told apart by their index.
        ids = [rid] if len(choices) == 1 else [f"{rid}-{c.index}" for c in choices]
        merged = interleave([self._stream(c.prompt, c.params, i, received_s) for c, i in zip(choices, ids)])
        try:
            head = await _heads(merged, len(choices))
        except BaseException:
            self.in_flight -= len(choices)
            await merged.aclose()
            raise
        refused = next((out for _, out in head if isinstance(out, GenerateError)), None)
        if refused is not None:  # the engine refused a prompt (or a lane failed): nothing was streamed yet
            self.in_flight -= len(choices)
            await merged.aclose()
            kind = "invalid_request_error" if refused.status < 500 else "service_unavailable"
            return _error(refused.status, refused.message, kind, refused.param)
        if body.stream:
            sse = self._sse(body, rid, chat, choices, _chain(head, merged))
            return StreamingResponse(sse, media_type="text/event-stream")
        try:
            items = head + await _until_error(merged)
        finally:
            self.in_flight -= len(choices)
            await merged.aclose()
        return self._final(body, rid, chat, choices, items)

    async def _stream(self, prompt, params, rid: str, received_s: float
                      ) -> AsyncIterator[RequestOutput | GenerateError]:
        """The engine's chunks, with the request timeout; leaving early cancels it in every lane."""
        start, first_token_at, last = time.perf_counter(), None, None
        called_s, first_s = time.time(), None
        # Its own request id in Serve's router: the n choices of one request are n calls at once (serve_calls.py).
        gen = (self.inbox.open(prompt, params, rid) if self.inbox is not None
               else own_request(self.engine.options(stream=True).generate, prompt, params, rid))
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                async for out in gen:
                    if isinstance(out, RequestOutput) and out.token_ids and first_token_at is None:
                        first_token_at, first_s = time.perf_counter(), time.time()
                    lost = isinstance(out, RequestOutput) and out.lane_lost
                    if isinstance(out, RequestOutput) and out.error:
                        out = self._internal(out, rid, "lane" if lost else "engine", out.error,
                                             lane_failed(rid) if lost else None)
                    if isinstance(out, RequestOutput) and out.finished:
                        # Counted before the client sees the end, so stats read after [DONE] include it.
                        self._record(out, start, first_token_at)
                    last = out
                    # A lane lost with no replica to take over reads as when the lane dies under the
                    # stream (below): 503, "retry".
                    yield GenerateError(503, out.error) if lost else out
            if not (isinstance(last, GenerateError) or isinstance(last, RequestOutput) and last.finished):
                # The decode lane's stream ended without the request's end (a replica that dropped it):
                # the client must not take a short or empty answer for a whole one.
                sent = last if isinstance(last, RequestOutput) else RequestOutput(rid, [], "")
                last = self._internal(dataclasses.replace(sent, token_ids=[], text="", logprobs=None,
                                                          prompt_logprobs=None, finished=True,
                                                          finish_reason="error"),
                                      rid, "incomplete", "the decode lane's stream ended without a finish_reason",
                                      stream_cut(rid))
                self._record(last, start, first_token_at)
                yield last
        except TimeoutError:
            last = RequestOutput(rid, [], "", True, "error", error=f"timed out after {self.cfg.request_timeout_s} s")
            self._record(last, start, first_token_at)
            yield last
        except Exception as exc:  # a lane replica died (or its engine did) under this request
            sent = last if isinstance(last, RequestOutput) else None
            # `last` becomes this finished output, so that `finally` does not count the request again.
            last = self._internal(RequestOutput(rid, [], "", True, "error", sent.num_prompt_tokens if sent else 0,
                                                sent.num_output_tokens if sent else 0),
                                  rid, "lane", repr(exc), lane_failed(rid))
            self._record(last, start, first_token_at)
            yield GenerateError(503, last.error)
        finally:
            gen.cancel()
            if isinstance(last, RequestOutput) and not last.finished:
                self._record(last, start, first_token_at)  # the client left, or the request timed out
            TIMELINE.record("request", received_s, time.time(), called_s=called_s, first_s=first_s, request_id=rid)

    def _internal(self, out: RequestOutput, rid: str, kind: str, detail: str, message: str | None = None
                  ) -> RequestOutput:
        """`out` failed inside the server: its detail to the log (with the request id) and the counter,
        a fixed message to the client."""
        log.warning("request %s failed (%s): %s", rid, kind, detail)
        self.metrics.observe_internal_error(kind)
        return dataclasses.replace(out, error=message or internal_error(rid))

    def _record(self, last: RequestOutput, start: float, first_token_at: float | None) -> None:
        status = "completed" if last.finished and not last.error else ("failed" if last.error else "cancelled")
        if last.stats is not None:
            self.totals.merge(last.stats)
        end = time.perf_counter()
        ttft_ms = (first_token_at - start) * 1e3 if first_token_at else None
        tpot_ms = ((end - first_token_at) * 1e3 / (last.num_output_tokens - 1)
                   if first_token_at and last.num_output_tokens > 1 else None)
        self.metrics.observe_request(status, ttft_ms, tpot_ms, (end - start) * 1e3, last.num_output_tokens)

    async def _sse(self, body, rid: str, chat: bool, choices: list[Choice], items) -> AsyncIterator[str]:
        """The SSE events of a started stream. An exception here in the ingress still ends it with an
        error event and [DONE], never mid-stream without a word."""
        try:
            async for event in self._sse_events(body, rid, chat, choices, items):
                yield event
        except Exception as exc:  # noqa: BLE001 - a bug here must not cut the client's stream
            self._internal(RequestOutput(rid, [], ""), rid, "ingress", repr(exc))
            yield _event(error_body(internal_error(rid), "server_error", 500))
            yield "data: [DONE]\n\n"

    async def _sse_events(self, body, rid: str, chat: bool, choices: list[Choice], items) -> AsyncIterator[str]:
        make = chat_choice if chat else completion_choice
        obj = "chat.completion.chunk" if chat else "text_completion"
        finals: dict[int, RequestOutput] = {}
        started: set[int] = set()
        try:
            async for index, out in items:
                if isinstance(out, GenerateError) or out.error:
                    # A final error event, then [DONE]: a client's SSE loop ends as it would normally.
                    # Leaving the loop aborts every other choice.
                    yield _event(error_body(out.message, "service_unavailable", out.status)
                                 if isinstance(out, GenerateError) else error_body(out.error, "server_error", 500))
                    yield "data: [DONE]\n\n"
                    return
                first = index not in started
                started.add(index)
                choice = make(index, out.text, out.finish_reason, True, first=first)
                choices[index].extras.decorate(choice, out, first)
                if body.return_token_ids:
                    choice["token_ids"] = out.token_ids
                event = response_body(rid, self.cfg.model_name, obj, [choice], None)
                if body.continuous_usage:  # vLLM's: the prompt and this choice's output so far
                    event["usage"] = running_usage(out.num_prompt_tokens, out.num_output_tokens)
                yield _event(event)
                if out.finished:
                    finals[index] = out
            if body.include_usage:
                finals_in_order = [finals[c.index] for c in choices]
                yield _event(response_body(rid, self.cfg.model_name, obj, [],
                                           total_usage(finals_in_order, body.n)))
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= len(choices)
            await items.aclose()

    def _final(self, body, rid: str, chat: bool, choices: list[Choice],
               items: list[tuple[int, RequestOutput | GenerateError]]):
        failed = next((out for _, out in items if isinstance(out, GenerateError) or out.error), None)
        if isinstance(failed, GenerateError):
            return _error(failed.status, failed.message, "service_unavailable")
        if failed is not None:
            return _error(500, failed.error, "server_error")
        merged = [merge_outputs([out for i, out in items if i == c.index]) for c in choices]
        make = chat_choice if chat else completion_choice
        answers = []
        for c, out in zip(choices, merged):
            answer = make(c.index, out.text, out.finish_reason, False)
            c.extras.decorate(answer, out, True)
            if body.return_token_ids:
                answer["token_ids"] = out.token_ids
            answers.append(answer)
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse(response_body(rid, self.cfg.model_name, obj, answers, total_usage(merged, body.n)))


async def _heads(items: AsyncIterator, num_choices: int) -> list:
    """The items up to the first of every choice (or up to a refusal): a request the engine refuses
    is answered with its status before any stream starts."""
    head, seen = [], set()
    async for index, out in items:  # leaving the loop early does not close `items`: the rest follows
        head.append((index, out))
        seen.add(index)
        if isinstance(out, GenerateError) or len(seen) == num_choices:
            break
    return head


async def _until_error(items: AsyncIterator) -> list:
    """The remaining items, stopping at the first failed choice (leaving aborts the others)."""
    rest = []
    async for index, out in items:
        rest.append((index, out))
        if isinstance(out, GenerateError) or out.error:
            break
    return rest


async def _chain(head: list, items: AsyncIterator) -> AsyncIterator:
    try:
        for item in head:
            yield item
        async for item in items:
            yield item
    finally:
        await items.aclose()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


IngressDeployment = serve.deployment(serve.ingress(api)(Ingress), name="Ingress")
