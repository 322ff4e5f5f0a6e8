"""Async front of the engine: `generate()` streams chunks while a background thread steps (AsyncEngine);
lanes/engine/process.py steps it in a process of its own behind the same front (StreamingFront).

The engine thread owns all engine state. Callers talk to it through a thread-safe inbox (new
requests, aborts, draft-length changes); it hands each step's outputs to the event loop in one
call, and each request's stream takes whatever has arrived since its last message, merged. So the
event loop never blocks on a forward pass and no lock is held across a step.

By default a stream sends each step's tokens as the step ends. Its next message is made only when
its consumer asks for it: a consumer that has not yet taken the previous one (its event loop busy)
gets the steps made meanwhile merged into one message rather than a queue of them (`num_coalesced`
counts those merges). Served, Serve takes each message at once whether or not the ingress keeps up
(benchmarks/results/stream_latency_h100/), so `max_stream_messages_per_s` (and `stream_interval_s`)
set a time floor between a stream's messages that its merges fill.
"""

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable

from lanes.engine.core import EngineCore
from lanes.engine.outputs import RequestOutput, merge_outputs
from lanes.engine.snapshot import EngineSnapshot, snapshot
from lanes.engine.step_trace import region
from lanes.sample.params import SamplingParams

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05


class _Stream:
    """One request's outputs on its event loop, pushed there once a step by the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: list[RequestOutput] = []
        self.error: Exception | None = None
        self._waiter: asyncio.Future | None = None

    def push(self, item: RequestOutput | Exception) -> None:
        """On the event loop."""
        if isinstance(item, Exception):
            self.error = item
        else:
            self.pending.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def ended(self) -> bool:
        return self.error is not None or bool(self.pending and self.pending[-1].finished)

    async def take(self, not_before_s: float) -> list[RequestOutput]:
        """What arrived since the last take (to be merged into one message). Waits for at least one
        chunk, then holds it until `not_before_s` (loop time) so that later steps' tokens join it,
        unless the request ends first: the last chunk is never held back."""
        while not (self.pending or self.error):
            self._waiter = self.loop.create_future()
            await self._waiter  # cancelled with the task: push() then finds it done
        while not self.ended and (left_s := not_before_s - self.loop.time()) > 0:
            self._waiter = self.loop.create_future()
            # asyncio.wait, not wait_for: a timeout must not cancel the waiter that push() resolves.
            await asyncio.wait([self._waiter], timeout=left_s)
        if self.error is not None:
            raise self.error
        taken, self.pending = self.pending, []
        return taken


def guarded(fn: Callable | None, *args) -> None:
    """`fn(*args)`, logging instead of raising: the thread that steps the engine or reads its steps
    must outlive any one failure (failed batches already answer their requests in EngineCore.step,
    and a metrics callback must not stop the streams)."""
    if fn is None:
        return
    try:
        fn(*args)
    except Exception:
        log.exception("engine: %s failed", getattr(fn, "__qualname__", fn))


class StreamingFront:
    """The event-loop side shared by the engine thread (AsyncEngine) and the engine process
    (lanes/engine/process.py): each request's stream, the coalescing interval, and the hand-off of a
    step's outputs to the event loops. Subclasses start requests (`_start`), abort them, and call
    `_deliver` with each step's outputs from their own thread."""

    def __init__(self, stream_interval_s: float = 0.0, max_stream_messages_per_s: float | None = None):
        # Least time between two messages of one stream after its first; 0: each step's tokens as it ends.
        self.stream_interval_s = stream_interval_s
        # Bound on messages per second over all streams (None: none): with n streams each one's interval
        # is at least n / this. Each message costs this process's event loop time; with the engine on a
        # thread here (AsyncEngine) that is GIL time its step loop waits for.
        self.max_stream_messages_per_s = max_stream_messages_per_s
        self.num_messages = 0  # chunks yielded to callers (each one a Ray message when served)
        # Step outputs that went out merged into another's message: a time floor above held it, or the
        # consumer had not taken the previous message yet.
        self.num_coalesced = 0
        self.num_steps = 0
        self.step_ms_total = 0.0  # time inside core.step(), summed
        self.progress_s = time.monotonic()  # when the engine last stepped or last reported itself idle
        self._streams: dict[str, _Stream] = {}
        self.device_fault: str | None = None  # a failed step left the device unusable (lanes/device/fault.py)
        self.lost: str | None = None  # a part the engine cannot step without is gone (`lose`)

    def problem(self, stall_s: float) -> str | None:
        """Why this engine cannot serve (None when it can): a failed step left its device unusable, its
        loop has exited, or it holds requests but has not stepped for `stall_s` (wedged: a hung
        kernel, a deadlock)."""
        if self.device_fault is not None:
            return f"the device is unusable after a failed step ({self.device_fault})"
        if self.lost is not None:
            return self.lost
        if not self.loop_alive():
            return "the engine loop has exited"
        quiet_s = time.monotonic() - self.progress_s
        if self._streams and quiet_s > stall_s:
            return f"{len(self._streams)} requests in flight and no engine step for {quiet_s:.0f} s"
        return None

    def loop_alive(self) -> bool:
        raise NotImplementedError

    def refusal(self) -> Exception | None:
        """What every request fails with now that the engine cannot serve (None while it can)."""
        if self.lost is not None:
            return EngineLost(self.lost)
        if self.device_fault is not None:
            return EngineDeviceFault(f"the engine's device is unusable: {self.device_fault}")
        return None

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's output chunks. Raises ParamError (before any chunk) on bad input.

        Each chunk carries every token made since the previous one: a step's tokens as it ends while
        the caller keeps up, several steps' once it takes its chunks more slowly than steps end; with
        `stream_interval_s` (or `max_stream_messages_per_s`, shared by every stream) at most one chunk
        per interval after the first. The first and the last chunk are never held. Leaving the
        iteration early (client gone, task cancelled) aborts the request and frees its KV slots.
        """
        if (refused := self.refusal()) is not None:
            raise refused
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop())
        self._start(request_id, prompt, params, stream, time.time())
        finished, not_before_s = False, 0.0
        try:
            while not finished:
                chunks = await stream.take(not_before_s)
                if interval_s := self._interval_s():
                    not_before_s = stream.loop.time() + interval_s
                out = merge_outputs(chunks)
                finished = out.finished
                self.num_messages += 1
                self.num_coalesced += len(chunks) - 1
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def _interval_s(self) -> float:
        if not self.max_stream_messages_per_s:
            return self.stream_interval_s
        return max(self.stream_interval_s, len(self._streams) / self.max_stream_messages_per_s)

    def _start(self, request_id: str, prompt, params: SamplingParams, stream: _Stream, arrival_s: float) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each event loop per step, not one
        per request (each wake-up takes the GIL from the thread that calls this)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_push_all, items)

    def _fail(self, request_id: str, exc: Exception) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.push, exc)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, exc)

    def lose(self, reason: str) -> None:
        """A part the engine cannot step without is gone (a tensor-parallel worker rank died): every
        request it holds fails now and every new one at once, and `problem()` says so, instead of
        waiting on a step that never ends. The engine is not stopped: it may be stuck in that step."""
        self.lost = reason
        self._fail_all(EngineLost(reason))


class EngineDeviceFault(RuntimeError):
    """The engine's device is unusable (a sticky CUDA error): every request it held fails with this."""


class EngineLost(RuntimeError):
    """A part the engine cannot step without is gone: every request it held fails with this."""


class AsyncEngine(StreamingFront):
    """The engine stepped by a thread of this process."""

    def __init__(self, core: EngineCore, on_step: Callable[[EngineSnapshot, float, int], None] | None = None,
                 on_idle: Callable[[EngineSnapshot], None] | None = None, stream_interval_s: float = 0.0,
                 max_stream_messages_per_s: float | None = None):
        super().__init__(stream_interval_s, max_stream_messages_per_s)
        self.core = core
        self.on_step = on_step  # (snapshot, step_time_ms, batch_size), on the engine thread after each step
        self.on_idle = on_idle  # (snapshot), on the engine thread about every IDLE_WAIT_S while idle
        self._inbox: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._stopped = False
        self._idle_step = False  # the last step made nothing and nothing is decoding
        # A remote prefiller (pd, pdv) wakes this loop when a prefill reply arrives.
        self._wakes_on_replies = hasattr(core.prefiller, "on_reply")
        if self._wakes_on_replies:
            core.prefiller.on_reply = self._wake.set
        self._thread = threading.Thread(target=self._run, name="vpd-engine", daemon=True)
        self._thread.start()

    def loop_alive(self) -> bool:
        return self._thread.is_alive()

    def _start(self, request_id: str, prompt, params: SamplingParams, stream: _Stream, arrival_s: float) -> None:
        # The engine thread takes it in at its next step boundary; the stream is held from now, so
        # that `lose` reaches it even if that boundary never comes.
        self._streams[request_id] = stream
        self._submit(lambda: self._add(request_id, prompt, params, stream, arrival_s))

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

    def _add(self, request_id: str, prompt, params: SamplingParams, stream: _Stream, arrival_s: float) -> None:
        if request_id not in self._streams:
            return  # failed or aborted while it waited in the inbox
        try:
            self.core.add_request(request_id, prompt, params, arrival_s)
        except Exception as exc:  # bad input fails this request only
            self._fail(request_id, exc)

    def _abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self._streams.pop(request_id, None)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()  # before draining, so a submit during the drain still wakes us
            while self._inbox:
                guarded(self._inbox.popleft())
            if not self.core.has_work:
                self.progress_s = time.monotonic()
                if self.on_idle is not None:
                    guarded(lambda: self.on_idle(snapshot(self.core)))
                self._wake.wait(IDLE_WAIT_S)
                continue
            guarded(self._step)
            if self._idle_step and self._wakes_on_replies:
                # Nothing decodes and every prompt is at the prefill lane: wait for a reply (or a
                # command) instead of stepping in a busy loop, which took a core from the lanes.
                self._wake.wait(IDLE_WAIT_S)

    def _step(self) -> None:
        batch_size = len(self.core.scheduler.running)
        start = time.perf_counter()
        outputs = self.core.step()
        self._idle_step = not outputs and not self.core.scheduler.running
        step_ms = (time.perf_counter() - start) * 1e3
        self.num_steps += 1
        self.step_ms_total += step_ms
        self.progress_s = time.monotonic()
        with region("deliver"):
            self._deliver(outputs)
        if self.core.device_fault is not None:
            self._stop_on_fault(self.core.device_fault)
            return
        if self.on_step is not None:
            self.on_step(snapshot(self.core), step_ms, batch_size)

    def _stop_on_fault(self, fault: str) -> None:
        # Every later step would fail too: stop stepping, fail what is held, and let the health
        # check (problem()) have Serve replace the replica.
        log.error("engine thread: the device is unusable (%s); stopping the engine loop", fault)
        self.device_fault = fault
        self._stopped = True
        self._fail_all(self.refusal())



def _push_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.push(out)
