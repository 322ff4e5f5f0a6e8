"""Client-visible errors of internal failures (issue 28): the real ingress (deployments/api/ingress.py) over
a real engine on the tiny pair, in process. The engine steps on its thread (AsyncEngine) behind the
decode replica's own `generate` (deployments/replicas/engine_replica.py); only Ray's transport between the two
is replaced, by `_Handle`, which can also drop a stream early (the fault a dead or stopping replica
causes). Each internal failure kind is forced for real, and every error body and SSE error event is
checked against the pattern of internals (tests/client_errors.py); a stream whose source ends without
its end still ends with an error event before [DONE]."""

import asyncio
import json
import time

import httpx
import pytest
import torch
from fastapi import FastAPI

from deployments.api.ingress import Ingress, InternalErrorMiddleware
from deployments.api.openai_protocol import CompletionRequest
from deployments.replicas.engine_replica import EngineServer
from deployments.telemetry.slo_signals import LatencyWindow
from lanes.engine.async_engine import AsyncEngine
from lanes.engine.backends import KVLost
from lanes.engine.core import EngineCore, EngineConfig
from lanes.model.loader import load_model
from tests.client_errors import assert_clean
from tests.serve_helpers import MODEL, app_config
from tests.test_kv_migration import _losing
from tests.test_oom_recovery import OOM_TEXT, _inject_oom

LEAKY = RuntimeError('Process 455 has 2.67 GiB memory in use; File "/work/lanes/spec/verify.py", line 132')


class _Replica:
    """What EngineServer.generate reads of its replica: the engine, the arrivals and in-flight counters, and
    the TTFT and TPOT windows the replica planner reads."""

    def __init__(self, engine: AsyncEngine):
        self.engine, self.num_arrivals, self.in_flight = engine, 0, 0
        self.ttft, self.tpot = LatencyWindow(), LatencyWindow()


class _Stream:
    def __init__(self, source, cut_after: int | None, garbage: bool):
        self.source, self.cut_after, self.garbage = source, cut_after, garbage

    def __aiter__(self):
        return self._items()

    async def _items(self):
        count = 0
        async for item in self.source:
            if self.cut_after is not None and count == self.cut_after:
                await self.source.aclose()
                return  # the transport ended the stream here: no finished output, no exception
            count += 1
            yield item
            if self.garbage:
                yield object()  # not an output: the ingress's own code fails on it

    def cancel(self):
        pass  # closing `source` (above, or by the ingress leaving) aborts the request in the engine


class _Handle:
    """Ray's streaming handle to the decode replica, in process: `options(stream=True).generate.remote`."""

    def __init__(self, engine: AsyncEngine, cut_after: int | None = None, garbage: bool = False):
        self.replica, self.cut_after, self.garbage = _Replica(engine), cut_after, garbage

    def options(self, stream: bool):
        return self

    @property
    def generate(self):
        return self

    def remote(self, prompt, params, rid):
        return _Stream(EngineServer.generate(self.replica, prompt, params, rid), self.cut_after, self.garbage)


@pytest.fixture(scope="module")
def paths(pair_paths):
    return pair_paths


def _engine(paths, **overrides) -> EngineCore:
    config = dict(max_model_len=256, max_num_seqs=4, num_speculative_tokens=3, prefill_chunk_tokens=32,
                  idle_prefill_tokens=64, block_size=4)
    config.update(overrides)
    return EngineCore.colocated(load_model(paths[0]), load_model(paths[1]), EngineConfig(**config))


async def _ask(ingress: Ingress, stream: bool, prompt="def f(x):", max_tokens: int = 12):
    body = CompletionRequest.model_validate({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0, "ignore_eos": True, "stream": stream})
    choices = ingress._choices(body, 0, body.prompts()[0], body.sampling_params(), False)
    response = await ingress._respond(body, choices, False, time.time())
    if not stream or not hasattr(response, "body_iterator"):
        return response.status_code, json.loads(response.body), []
    events = [chunk.removeprefix("data: ").strip() async for chunk in response.body_iterator]
    return response.status_code, None, events


def _serve(paths, core: EngineCore, ask, **handle):
    async def main():
        engine = AsyncEngine(core)
        try:
            ingress = Ingress(_Handle(engine, **handle), app_config("unified", *paths))
            return await ask(ingress)
        finally:
            engine.shutdown()
    return asyncio.run(main())


def _error_messages(status: int, body: dict | None, events: list[str]) -> list[str]:
    """Every error message the client got: the body's, or the SSE error events' (then [DONE] last)."""
    if body is not None:
        assert status >= 400 and "error" in body, (status, body)
        return [body["error"]["message"]]
    errors = [json.loads(e)["error"]["message"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    return errors


def _poisoned(core: EngineCore) -> EngineCore:
    _inject_oom(core, lambda prefill, ids, call: True)  # every target forward: out of memory exhausted
    return core


def _verify_raises(core: EngineCore) -> EngineCore:
    def launch(batch):
        raise LEAKY
    core.verifier.launch = launch
    return core


def _kv_lost(core: EngineCore) -> EngineCore:
    _losing(core, lambda n, batch: (list(range(len(batch.target_slots))), KVLost(str(LEAKY))))
    return core


def _prefill_fails(core: EngineCore) -> EngineCore:
    def run(chunks):
        raise torch.OutOfMemoryError(OOM_TEXT)
    core.prefiller.lane.run = run
    return core


FAILURES = {
    "oom_exhausted": (_poisoned, dict(max_oom_attempts=1)),
    "verify_failed": (_verify_raises, {}),
    "kv_lost_too_often": (_kv_lost, dict(max_migrations=1)),
    "prefill_oom_exhausted": (_prefill_fails, dict(max_oom_attempts=1)),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_every_internal_failure_reaches_the_client_as_a_fixed_message(paths, failure, stream):
    inject, overrides = FAILURES[failure]
    status, body, events = _serve(paths, inject(_engine(paths, **overrides)), lambda ingress: _ask(ingress, stream))
    messages = _error_messages(status, body, events)
    assert messages
    for message in messages:
        assert_clean(message)
        assert "was logged" in message


def test_a_stream_whose_source_ends_early_ends_with_an_error_event(paths):
    status, _, events = _serve(paths, _engine(paths), lambda ingress: _ask(ingress, True, max_tokens=40),
                               cut_after=1)
    assert status == 200
    assert any("choices" in json.loads(e) for e in events[:-1] if e != "[DONE]")  # it had started
    [message] = _error_messages(status, None, events)
    assert_clean(message)
    status, body, _ = _serve(paths, _engine(paths), lambda ingress: _ask(ingress, False, max_tokens=40),
                             cut_after=1)
    [message] = _error_messages(status, body, [])
    assert_clean(message)


def test_an_exception_inside_the_ingress_ends_the_stream_with_a_clean_error_event(paths):
    status, _, events = _serve(paths, _engine(paths), lambda ingress: _ask(ingress, True), garbage=True)
    assert status == 200
    [message] = _error_messages(status, None, events)
    assert_clean(message)


def test_an_exception_escaping_a_handler_is_an_openai_500_with_a_clean_message():
    app = FastAPI()  # the middleware where the ingress's app has it: inside Starlette's own error handler
    app.add_middleware(InternalErrorMiddleware)

    @app.post("/v1/completions")
    async def broken():
        raise RuntimeError(str(LEAKY))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as http:
            return await http.post("/v1/completions", json={})

    response = asyncio.run(main())
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == 500
    assert_clean(error["message"])
