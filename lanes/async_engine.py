"""Async front of the co-located engine: `generate()` streams chunks while a background thread steps.

The engine thread owns all engine state. Callers talk to it through a thread-safe inbox (new
requests, aborts, draft-length changes) and get results through per-request asyncio queues, so
the event loop never blocks on a forward pass and no lock is held across a step.
"""

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from lanes.engine_core import EngineCore
from lanes.outputs import RequestOutput
from lanes.params import SamplingParams

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05


@dataclass
class _Client:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, core: EngineCore, on_step: Callable[[EngineCore, float, int], None] | None = None,
                 on_idle: Callable[[EngineCore], None] | None = None):
        self.core = core
        self.on_step = on_step  # (core, step_time_ms, batch_size), on the engine thread after each step
        self.on_idle = on_idle  # (core), on the engine thread about every IDLE_WAIT_S while idle
        self._inbox: deque[Callable[[], None]] = deque()
        self._clients: dict[str, _Client] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="vpd-engine", daemon=True)
        self._thread.start()

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's output chunks. Raises ParamError (before any chunk) on bad input.

        Leaving the iteration early (client gone, task cancelled) aborts the request and frees its
        KV slots.
        """
        request_id = request_id or uuid.uuid4().hex
        client = _Client(asyncio.get_running_loop(), asyncio.Queue())
        arrival_s = time.time()  # the engine thread takes it in at its next step boundary
        self._submit(lambda: self._add(request_id, prompt, params, client, arrival_s))
        finished = False
        try:
            while not finished:
                item = await client.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id))

    def set_draft_lengths(self, default_len: int, per_request: dict[str, int] | None = None) -> None:
        self._submit(lambda: self.core.set_draft_lengths(default_len, per_request))

    def call(self, fn: Callable[[EngineCore], object]) -> "asyncio.Future":
        """Run `fn(core)` on the engine thread between steps (consistent reads of engine state)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run():
            try:
                result = fn(self.core)
                loop.call_soon_threadsafe(future.set_result, result)
            except Exception as exc:
                loop.call_soon_threadsafe(future.set_exception, exc)

        self._submit(run)
        return future

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- engine thread ------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        self._inbox.append(command)
        self._wake.set()

    def _add(self, request_id: str, prompt, params: SamplingParams, client: _Client, arrival_s: float) -> None:
        try:
            self.core.add_request(request_id, prompt, params, arrival_s)
        except Exception as exc:  # bad input fails this request only
            client.put(exc)
            return
        self._clients[request_id] = client

    def _abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self._clients.pop(request_id, None)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()  # before draining, so a submit during the drain still wakes us
            while self._inbox:
                self._guard(self._inbox.popleft())
            if not self.core.has_work:
                if self.on_idle is not None:
                    self._guard(lambda: self.on_idle(self.core))
                self._wake.wait(IDLE_WAIT_S)
                continue
            self._guard(self._step)

    def _step(self) -> None:
        batch_size = len(self.core.scheduler.running)
        start = time.perf_counter()
        outputs = self.core.step()
        step_ms = (time.perf_counter() - start) * 1e3
        for out in outputs:
            self._deliver(out)
        if self.on_step is not None:
            self.on_step(self.core, step_ms, batch_size)

    @staticmethod
    def _guard(fn: Callable[[], object]) -> None:
        # The engine thread must outlive any single failure; failed batches already answer their
        # requests inside EngineCore.step.
        try:
            fn()
        except Exception:
            log.exception("engine thread: command failed")

    def _deliver(self, out: RequestOutput) -> None:
        client = self._clients.get(out.request_id)
        if client is None:
            return
        if out.finished:
            del self._clients[out.request_id]
        client.put(out)
