"""A single worker thread per replica for GPU work, so the replica's event loop stays responsive
and every mutation of a lane's pool is serialised without locks. On a GPU the thread issues its
work on a stream of the lane's priority (lanes/device/streams.py), which also orders lanes of different
replicas that share the GPU."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

from lanes.device.fault import device_fault
from lanes.device.streams import lane_stream
from lanes.engine.step_cap import free_cached_memory

T = TypeVar("T")

WEDGED_AFTER_S = 60.0  # one job running longer than this: a hung kernel or a deadlock, not work


class LaneLost(RuntimeError):
    """The lane lost a part its jobs need (`LaneWorker.lose`): its replica is being replaced."""


def _settle(waiting: asyncio.Future, job: asyncio.Future) -> None:
    if job.cancelled():
        waiting.cancel()  # a no-op where `lose` failed it first
    elif job.exception() is not None:  # read even when `lose` failed the caller first: it is retrieved
        if not waiting.done():
            waiting.set_exception(job.exception())
    elif not waiting.done():
        waiting.set_result(job.result())


class LaneWorker:
    def __init__(self, name: str, device: torch.device, priority: int):
        stream = lane_stream(device, priority)

        def use_lane_stream():
            if stream is not None:
                torch.cuda.set_stream(stream)

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=use_lane_stream)
        self.device = device
        self.stream = stream  # the jobs' current stream (None on the CPU)
        self.device_fault: str | None = None  # set when a failed job left the device unusable
        self.lost: str | None = None  # set when a part the lane's jobs need is gone (`lose`)
        self._busy_since_s: float | None = None  # monotonic start of the job running now
        self._waiting: set[asyncio.Future] = set()  # what callers await, failed at once by `lose`

    async def run(self, fn: Callable[..., T], *args) -> T:
        if self.lost is not None:
            raise LaneLost(self.lost)
        job = asyncio.get_running_loop().run_in_executor(self._executor, self._call, fn, args)
        waiting = asyncio.get_running_loop().create_future()
        job.add_done_callback(lambda done: _settle(waiting, done))
        self._waiting.add(waiting)
        try:
            return await waiting
        finally:
            self._waiting.discard(waiting)

    def lose(self, reason: str) -> None:
        """A part every job needs is gone (a tensor-parallel worker rank: a job would wait on it in a
        collective). Fail every job awaited now and every later one, and the health check, at once."""
        self.lost = reason
        for waiting in list(self._waiting):
            if not waiting.done():
                waiting.set_exception(LaneLost(reason))

    def problem(self, wedged_after_s: float = WEDGED_AFTER_S) -> str | None:
        """Why this lane cannot serve (None when it can), for its replica's health check."""
        if self.lost is not None:
            return self.lost
        if self.device_fault is not None:
            return f"the device is unusable after a failed job ({self.device_fault})"
        busy_since_s = self._busy_since_s
        if busy_since_s is not None and time.monotonic() - busy_since_s > wedged_after_s:
            return f"one job has run for {time.monotonic() - busy_since_s:.0f} s"
        return None

    def _call(self, fn: Callable[..., T], args: tuple) -> T:
        self._busy_since_s = time.monotonic()
        try:
            return fn(*args)
        except torch.OutOfMemoryError:
            # Not a dead device: give the failed job's cached memory back for the smaller retry.
            free_cached_memory(self.device)
            raise
        except Exception:
            # Probed here, on the thread and stream that met the failure, before the next job.
            self.device_fault = self.device_fault or device_fault(self.device)
            raise
        finally:
            self._busy_since_s = None
