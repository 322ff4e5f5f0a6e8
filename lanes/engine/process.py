"""The engine stepped in a process of its own, as vLLM V1 runs its engine core.

A thread in the replica's process shares one GIL with the replica's event loop and Ray's threads;
every torch call of the step gives the GIL up and must win it back. Measured on an H100, a served
step took 1.7x its in-process time that way (docs/performance.md). Here the step loop owns a process
and its GIL; the replica keeps only the streams (StreamingFront).

The two processes talk over a socket pair with pickled tuples:
- replica -> engine: ("add", id, prompt, params, arrival_s), ("abort", id),
  ("draft", default_len, per_request), ("call", call_id, fn), ("stop",)
- engine -> replica: ("ready", info) or ("failed", traceback) once; then ("step", outputs, step_ms,
  batch_size, snapshot) after every step, ("idle", snapshot) now and then while idle,
  ("sample", value) every `sample_interval_s`, ("refused", id, error), ("result", call_id, ok, value)

One message a step carries every request's new tokens, however many requests there are. The engine
process exits when its replica closes the socket, or dies (it reads end-of-file).
"""

import asyncio
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

from lanes.engine.async_engine import IDLE_WAIT_S, StreamingFront, _Stream, guarded
from lanes.engine.snapshot import EngineSnapshot, snapshot
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
                 max_stream_messages_per_s: float | None = None, start_timeout_s: float = 900.0):
        super().__init__(stream_interval_s, max_stream_messages_per_s)
        self.on_step, self.on_idle, self.on_sample = on_step, on_idle, on_sample
        self.alive = False
        self._stopped = False
        self._send_lock = threading.Lock()
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._proc, self._conn = _spawn()
        self._send(("setup", factory, describe, sampler, sample_interval_s))
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
                self._conn.send(message)
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
        kind, payload = self._conn.recv()
        if kind != "ready":
            self._proc.wait()
            raise RuntimeError(f"the engine process failed to build its engine:\n{payload}")
        return payload

    def _read(self) -> None:
        try:
            while True:
                self._dispatch(self._conn.recv())
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


class _EngineLoop:
    """Steps the engine while it has work; between steps, takes every command that has arrived."""

    def __init__(self, core, conn: Connection, sampler: Callable[[], object] | None, sample_interval_s: float):
        self.core = core
        self.conn = conn
        self.sampler = sampler
        self.sample_interval_s = sample_interval_s
        self._sampled_at_s = -sample_interval_s
        self._idle_reported_at_s = -IDLE_REPORT_S

    def run(self) -> None:
        while self._take_commands(0.0 if self.core.has_work else IDLE_WAIT_S):
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
            step_ms = (time.perf_counter() - start) * 1e3
            self._send(("step", outputs, step_ms, batch_size, snapshot(self.core)))
            if self.core.device_fault is not None:
                # Every later step would fail too: report it and exit, so that the replica fails
                # what it holds and its health check has Serve replace it (vLLM's engine core dies
                # on such errors as well).
                log.error("engine process: the device is unusable (%s); exiting", self.core.device_fault)
                self._send(("fault", self.core.device_fault))
                return

    def _take_commands(self, timeout_s: float) -> bool:
        """Apply every command waiting now (waiting up to `timeout_s` for the first); False to stop."""
        try:
            while self.conn.poll(timeout_s):
                timeout_s = 0.0
                if not self._apply(self.conn.recv()):
                    return False
        except (EOFError, OSError):  # the replica is gone
            return False
        return True

    def _apply(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, params, arrival_s = message
            try:
                self.core.add_request(request_id, prompt, params, arrival_s)
            except Exception as exc:  # bad input fails this request only
                self._send(("refused", request_id, _picklable(exc)))
        elif kind == "abort":
            self.core.abort(message[1])
        elif kind == "draft":
            self.core.set_draft_lengths(message[1], message[2])
        elif kind == "call":
            _, call_id, fn = message
            try:
                self._send(("result", call_id, True, fn(self.core)))
            except Exception as exc:
                self._send(("result", call_id, False, _picklable(exc)))
        elif kind == "stop":
            return False
        return True

    def _send(self, message: tuple) -> None:
        self.conn.send(message)


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def main(fd: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-process %(levelname)s %(message)s")
    conn = Connection(fd)
    try:
        _, factory, describe, sampler, sample_interval_s = conn.recv()
        core = factory()
        info = describe(core) if describe is not None else None
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", info))
    try:
        _EngineLoop(core, conn, sampler, sample_interval_s).run()
    except (BrokenPipeError, ConnectionResetError):  # the replica is gone
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]))
