"""The engine stepped in a process of its own, as vLLM V1 runs its engine core.

A thread in the replica's process shares one GIL with the replica's event loop and Ray's threads;
every torch call of the step gives the GIL up and must win it back. Measured on an H100, a served
step took 1.7x its in-process time that way (docs/performance.md). Here the step loop owns a process
and its GIL; the replica keeps only the streams (StreamingFront).

The two processes talk over a socket pair with pickled tuples:
- replica -> engine: ("add", id, prompt, params, arrival_s), ("abort", id),
  ("draft", default_len, per_request), ("call", call_id, fn), ("peer_answer", call_id, value), ("stop",)
- engine -> replica: ("ready", info) or ("failed", traceback) once; then ("step", outputs, step_ms,
  batch_size, snapshot) after every step, ("idle", snapshot) now and then while idle,
  ("sample", value) every `sample_interval_s`, ("refused", id, error), ("result", call_id, ok, value),
  ("peer", call_id, request), ("record", kind, start_s, end_s, info)

An engine that reaches other lanes (pd's and pdv's decode lane: prompts to the prefill lane, pdv's verify
batches to the verify lane) does so through its replica, the process with Ray: it sends ("peer", ...),
the replica answers it from its event loop (`serve_peer`), and the engine process's reader thread
hands the answer to the caller (`PeerLink`), which may be waiting for it inside a step.

One message a step carries every request's new tokens, however many requests there are. The engine
process exits when its replica closes the socket, or dies (it reads end-of-file).
"""

import asyncio
import itertools
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection, wait

from lanes.engine.async_engine import IDLE_WAIT_S, StreamingFront, _Stream, guarded
from lanes.engine.snapshot import EngineSnapshot, snapshot
from lanes.engine.step_trace import region
from lanes.sample.params import SamplingParams

log = logging.getLogger(__name__)

IDLE_REPORT_S = 1.0  # how often an idle engine sends its snapshot (gauges must be re-set, not just once)


class EngineProcessDied(RuntimeError):
    """The engine process exited; every request it held ends with this error."""


class ProcessEngine(StreamingFront):
    """`generate`, `abort`, `set_draft_lengths`, `call` and `shutdown` as AsyncEngine has them, for an
    engine that `factory()` builds in a child process.

    `describe(core)` runs there once and its value becomes `info`; `sampler()` runs there every
    `sample_interval_s` and its value goes to `on_sample`. All three must pickle (module-level
    functions, partials of them). The callbacks run on this process's reader thread."""

    def __init__(self, factory: Callable[[], object], *, describe: Callable | None = None,
                 on_step: Callable[[EngineSnapshot, float, int], None] | None = None,
                 on_idle: Callable[[EngineSnapshot], None] | None = None,
                 sampler: Callable[[], object] | None = None, on_sample: Callable[[object], None] | None = None,
                 sample_interval_s: float = 2.0, stream_interval_s: float = 0.0,
                 max_stream_messages_per_s: float | None = None, start_timeout_s: float = 900.0,
                 serve_peer: Callable[[object], Awaitable[object]] | None = None, node_id: str | None = None,
                 on_record: Callable[..., None] | None = None):
        super().__init__(stream_interval_s, max_stream_messages_per_s)
        self.on_step, self.on_idle, self.on_sample = on_step, on_idle, on_sample
        # `serve_peer(request)`: answers the engine's peer calls on this event loop (the factory is then
        # called with `peer_link=`, a PeerLink in the engine process); it must not raise. `on_record`:
        # the timeline events the engine reports (kind, start_s, end_s, **info).
        self.serve_peer, self.on_record = serve_peer, on_record
        self._loop = asyncio.get_event_loop() if serve_peer is not None else None
        self.alive = False
        self._stopped = False
        self._send_lock = threading.Lock()
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._proc, self._conn = _spawn()
        self._send(("setup", factory, describe, sampler, sample_interval_s, serve_peer is not None, node_id))
        self.info = self._wait_ready(start_timeout_s)
        self.alive = True
        self._reader = threading.Thread(target=self._read, name="vpd-engine-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def loop_alive(self) -> bool:
        return self.alive

    def _start(self, request_id: str, prompt, params: SamplingParams, stream: _Stream, arrival_s: float) -> None:
        self._streams[request_id] = stream
        if not self.alive:
            self._fail(request_id, self._gone())
            return
        self._send(("add", request_id, prompt, params, arrival_s))

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._send(("abort", request_id))

    def set_draft_lengths(self, default_len: int, per_request: dict[str, int] | None = None) -> None:
        self._send(("draft", default_len, per_request))

    def call(self, fn: Callable) -> "asyncio.Future":
        """Run `fn(core)` in the engine process between steps; `fn` must pickle (a module-level function)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self.alive:
            future.set_exception(EngineProcessDied("the engine process is not running"))
            return future
        call_id = next(self._call_ids)
        self._calls[call_id] = (loop, future)
        self._send(("call", call_id, fn))
        return future

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._send(("stop",))
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()

    # ---- this process's side of the socket -------------------------------------------------

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                put_message(self._conn, message)
        except (OSError, ValueError):  # closed: the reader thread fails what the engine held
            pass

    def _wait_ready(self, timeout_s: float):
        deadline_s = time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            if self._proc.poll() is not None:
                raise EngineProcessDied(f"the engine process exited with {self._proc.returncode} while starting")
            if time.monotonic() > deadline_s:
                self._proc.kill()
                raise TimeoutError(f"the engine process did not start within {timeout_s:.0f} s")
        kind, payload = take_message(self._conn)
        if kind != "ready":
            self._proc.wait()
            raise RuntimeError(f"the engine process failed to build its engine:\n{payload}")
        return payload

    def _read(self) -> None:
        try:
            while True:
                self._dispatch(take_message(self._conn))
        except (EOFError, OSError):
            pass
        finally:
            self._died()

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, outputs, step_ms, batch_size, snap = message
            self.num_steps += 1
            self.step_ms_total += step_ms
            self.progress_s = time.monotonic()
            self._deliver(outputs)
            guarded(self.on_step, snap, step_ms, batch_size)
        elif kind == "idle":
            self.progress_s = time.monotonic()
            guarded(self.on_idle, message[1])
        elif kind == "sample":
            guarded(self.on_sample, message[1])
        elif kind == "refused":
            self._fail(message[1], message[2])
        elif kind == "fault":
            self.device_fault = message[1]
        elif kind == "result":
            _, call_id, ok, value = message
            loop, future = self._calls.pop(call_id)
            loop.call_soon_threadsafe(_settle, future, ok, value)
        elif kind == "peer":
            asyncio.run_coroutine_threadsafe(self._answer_peer(message[1], message[2]), self._loop)
        elif kind == "record" and self.on_record is not None:
            _, record_kind, start_s, end_s, info = message
            guarded(lambda: self.on_record(record_kind, start_s, end_s, **info))

    async def _answer_peer(self, call_id: int, request) -> None:
        try:
            value = await self.serve_peer(request)
        except Exception as exc:  # serve_peer answers failures as values; this is a bug, not a lane's loss
            log.exception("engine process: a peer call failed")
            value = exc
        self._send(("peer_answer", call_id, picklable(value) if isinstance(value, Exception) else value))

    def _gone(self) -> Exception:
        return self.refusal() or EngineProcessDied("the engine process is not running")

    def _died(self) -> None:
        self.alive = False
        if not self._stopped:
            log.error("engine process %d exited (code %s); failing %d requests", self._proc.pid,
                      self._proc.poll(), len(self._streams))
        error = self._gone()
        self._fail_all(error)
        for call_id in list(self._calls):
            loop, future = self._calls.pop(call_id)
            loop.call_soon_threadsafe(_settle, future, False, error)


def _settle(future: asyncio.Future, ok: bool, value) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def put_message(conn: Connection, message: tuple) -> None:
    """Send one message (the engine socket's, and pdv's verify channels: deployments/channels/verify_channel.py)."""
    # Plain pickle, not Connection.send's: torch registers reductions with multiprocessing's pickler
    # that share a CPU tensor through a file descriptor server which only a child made by
    # multiprocessing may reach (a prefill order's first-token mask failed with AuthenticationError).
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def take_message(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


def _spawn() -> tuple[subprocess.Popen, Connection]:
    """A fresh interpreter (not a fork: this process may hold CUDA, Ray and thread state that a fork
    would copy half-made) running this module, joined to us by a socket pair."""
    ours, theirs = socket.socketpair()
    # The child imports what this process imports: give it our module search path.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-m", "lanes.engine.process", str(theirs.fileno())],
                            pass_fds=[theirs.fileno()], env=env)
    theirs.close()
    return proc, Connection(ours.detach())


# ---- the engine process ---------------------------------------------------------------------


class PeerLink:
    """The engine process's way to the lanes its replica reaches through Ray (given to the engine's
    factory as `peer_link`). `call(request, on_done)` sends `request` to the replica, which answers it
    from its event loop (ProcessEngine's `serve_peer`); `on_done(answer)` runs on this process's reader
    thread when the answer comes, so an engine may wait for it inside a step (a verify call), and with
    the exception instead if the replica is gone. `record` sends a timeline event to the replica, whose
    timeline the benchmarks read."""

    def __init__(self, send: Callable[[tuple], None], node_id: str | None):
        self.node_id = node_id  # the replica's Ray node: where this process's pools are, to its peers
        self._send = send
        self._pending: dict[int, Callable[[object], None]] = {}
        self._lock = threading.Lock()
        self._gone: BaseException | None = None
        self._ids = itertools.count()

    def call(self, request, on_done: Callable[[object], None]) -> None:
        with self._lock:
            gone = self._gone
            if gone is None:
                call_id = next(self._ids)
                self._pending[call_id] = on_done
        if gone is not None:
            on_done(gone)
            return
        self._send(("peer", call_id, request))

    def answer(self, call_id: int, value) -> None:
        with self._lock:
            on_done = self._pending.pop(call_id, None)
        guarded(on_done, value)

    def fail_all(self, exc: BaseException) -> None:
        """The replica is gone: every call waiting, and every later one, gets `exc`."""
        with self._lock:
            self._gone = exc
            pending, self._pending = self._pending, {}
        for on_done in pending.values():
            guarded(on_done, exc)

    def record(self, kind: str, start_s: float, end_s: float, **info) -> None:
        self._send(("record", kind, start_s, end_s, info))


class _EngineLoop:
    """Steps the engine while it has work; between steps, takes every command that has arrived. A
    reader thread takes the replica's messages off the socket: commands wait in the inbox for the
    next step boundary, peer answers go to their callers at once (an engine may be waiting for one
    inside its step)."""

    def __init__(self, conn: Connection, sampler: Callable[[], object] | None, sample_interval_s: float):
        self.core = None
        self.link: PeerLink | None = None
        self.conn = conn
        self.sampler = sampler
        self.sample_interval_s = sample_interval_s
        self._sampled_at_s = -sample_interval_s
        self._idle_reported_at_s = -IDLE_REPORT_S
        self._idle_step = False  # the last step made nothing and nothing decodes: every prompt is at a peer
        self._send_lock = threading.Lock()  # the engine thread, the reader thread (peer callbacks) send
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_writer.setblocking(False)
        self._wake_reader.setblocking(False)

    def attach(self, core, link: PeerLink | None) -> None:
        """The engine to step (built after this loop, whose `_send` and `wake` its PeerLink uses)."""
        self.core, self.link = core, link
        if link is not None and hasattr(core.prefiller, "on_reply"):
            core.prefiller.on_reply = self.wake
        threading.Thread(target=self._read, name="vpd-engine-inbox", daemon=True).start()

    def wake(self) -> None:
        try:
            self._wake_writer.send(b"\0")
        except OSError:  # already woken (the buffer is full: BlockingIOError), or closing
            pass

    def _read(self) -> None:
        try:
            while True:
                message = take_message(self.conn)
                if message[0] == "peer_answer":
                    self.link.answer(message[1], message[2])
                else:
                    self._inbox.put(message)
                    self.wake()
        except (EOFError, OSError):  # the replica is gone: stop, and free whatever waits on it
            if self.link is not None:
                self.link.fail_all(EngineProcessDied("the engine's replica is gone"))
            self._inbox.put(("stop",))
            self.wake()

    def run(self) -> None:
        while self._take_commands(0.0 if self.core.has_work and not self._idle_step else IDLE_WAIT_S):
            now_s = time.monotonic()
            if self.sampler is not None and now_s - self._sampled_at_s >= self.sample_interval_s:
                self._sampled_at_s = now_s
                self._send(("sample", self.sampler()))
            if not self.core.has_work:
                if now_s - self._idle_reported_at_s >= IDLE_REPORT_S:
                    self._idle_reported_at_s = now_s
                    self._send(("idle", snapshot(self.core)))
                continue
            batch_size = len(self.core.scheduler.running)
            start = time.perf_counter()
            try:
                outputs = self.core.step()
            except Exception:  # failed batches answer their requests inside EngineCore.step
                log.exception("engine process: step failed")
                continue
            # Nothing decodes and every prompt is at the prefill lane: wait for its answer (it wakes
            # the loop) instead of stepping in a busy loop.
            self._idle_step = self.link is not None and not outputs and not self.core.scheduler.running
            step_ms = (time.perf_counter() - start) * 1e3
            with region("send_outputs"):
                self._send(("step", outputs, step_ms, batch_size, snapshot(self.core)))
            if self.core.device_fault is not None:
                # Every later step would fail too: report it and exit, so that the replica fails
                # what it holds and its health check has Serve replace it (vLLM's engine core dies
                # on such errors as well).
                log.error("engine process: the device is unusable (%s); exiting", self.core.device_fault)
                self._send(("fault", self.core.device_fault))
                return

    def _take_commands(self, timeout_s: float) -> bool:
        """Apply every command waiting now (waiting up to `timeout_s` for one, or for a wake); False to stop."""
        if timeout_s > 0 and self._inbox.empty() and wait([self._wake_reader], timeout_s):
            try:
                self._wake_reader.recv(4096)
            except BlockingIOError:
                pass
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if not self._apply(message):
                return False

    def _apply(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, params, arrival_s = message
            try:
                self.core.add_request(request_id, prompt, params, arrival_s)
            except Exception as exc:  # bad input fails this request only
                self._send(("refused", request_id, picklable(exc)))
        elif kind == "abort":
            self.core.abort(message[1])
        elif kind == "draft":
            self.core.set_draft_lengths(message[1], message[2])
        elif kind == "call":
            _, call_id, fn = message
            try:
                self._send(("result", call_id, True, fn(self.core)))
            except Exception as exc:
                self._send(("result", call_id, False, picklable(exc)))
        elif kind == "stop":
            return False
        return True

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            put_message(self.conn, message)


def picklable(exc: BaseException) -> BaseException:
    """`exc`, or a copy that crosses the socket keeping what the engine reads it by. A class pickle
    cannot find by its name (one that Serve shipped by value: a class defined in a request router's module)
    becomes its nearest base that can (a KVLost: the request is recomputed, not failed)."""
    for cls in type(exc).__mro__:
        if not issubclass(cls, BaseException):
            break
        try:
            copy = exc if cls is type(exc) else cls(*exc.args)
            if copy is not exc:
                copy.__dict__.update(exc.__dict__)
            pickle.loads(pickle.dumps(copy))
            return copy
        except Exception:
            continue
    return RuntimeError(f"{type(exc).__name__}: {exc}")


def main(fd: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-process %(levelname)s %(message)s")
    conn = Connection(fd)
    try:
        _, factory, describe, sampler, sample_interval_s, has_peers, node_id = take_message(conn)
        loop = _EngineLoop(conn, sampler, sample_interval_s)
        link = PeerLink(loop._send, node_id) if has_peers else None
        core = factory(peer_link=link) if link is not None else factory()
        info = describe(core) if describe is not None else None
    except BaseException:
        put_message(conn, ("failed", traceback.format_exc()))
        return
    put_message(conn, ("ready", info))
    try:
        loop.attach(core, link)
        loop.run()
    except (BrokenPipeError, ConnectionResetError):  # the replica is gone
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]))
