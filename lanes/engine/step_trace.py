"""A torch.profiler trace of a running engine's next steps: where a step's host and device time go.

The lane timelines say how long a step took and how long it waited on a remote lane; they cannot say
what the rest of the step did. This records `num_steps` whole steps of a live engine (each window
starts at a step's start and ends at the next step's start, so the loop's work between steps, such as
sending the outputs to the replica, is inside it) and writes:
- `<name>.trace.json.gz`: the Chrome/Perfetto trace (chrome://tracing, ui.perfetto.dev);
- `<name>.summary.json`: per step, the host time of each region of the step (`region`, named
  `vpd.*`) and the device-side span of its kernels, the device's busy time (the union of this process's
  kernels' intervals) and the largest host ops and kernels.

Started between two steps by a call into the engine (`start_trace`, e.g. through
`EngineServer.trace`), so a replica serving load can be traced where it stands, as vLLM's
`/start_profile` does. The profiler slows what it records: a traced step's times say where the time
goes, not how fast the engine is.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import shutil
import time
from collections import Counter
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

log = logging.getLogger(__name__)

REGION_PREFIX = "vpd."
TOP_OPS = 20
_NO_REGION = contextlib.nullcontext()
_tracing = False  # a trace is recording in this process: `region` then names its part of the step


def region(name: str):
    """A named part of a step in a recording trace; free (a shared null context) otherwise."""
    return record_function(REGION_PREFIX + name) if _tracing else _NO_REGION


class StepTrace:
    """Records the engine's next `num_steps` steps (`before_step` is called at the start of each)."""

    def __init__(self, num_steps: int, out_dir: str | Path, name: str):
        if num_steps < 1:
            raise ValueError(f"num_steps must be at least 1, got {num_steps}")
        self.num_steps, self.out_dir, self.name = num_steps, Path(out_dir), name
        self.steps_seen = 0
        self.summary: dict | None = None  # set once written
        self._profile: profile | None = None
        self._start_s = 0.0

    @property
    def done(self) -> bool:
        return self.summary is not None

    def before_step(self) -> None:
        """Count a step about to start: the first starts the recording, the one after the last stops it.
        Never raises: a profiler that fails ends the trace with the error in its summary, and the engine
        steps on."""
        if self.done:
            return
        try:
            if self._profile is None:
                self._begin()
            elif self.steps_seen == self.num_steps:
                self.finish()
                return
        except Exception as exc:
            self._fail(exc)
            return
        self.steps_seen += 1

    def finish(self) -> dict:
        """Stop now (after fewer steps if the engine went idle) and write the files; the summary."""
        if self.summary is not None:
            return self.summary
        if self._profile is None:
            self.summary = {"name": self.name, "steps": 0}
            return self.summary
        try:
            return self._stop_and_write()
        except Exception as exc:
            return self._fail(exc)

    def _fail(self, exc: Exception) -> dict:
        global _tracing
        _tracing = False
        if self._profile is not None:
            with contextlib.suppress(Exception):  # it may never have started, or have stopped already
                self._profile.stop()
        log.exception("step trace %s failed; the engine steps on untraced", self.name)
        self.summary = {"name": self.name, "steps": self.steps_seen, "error": f"{type(exc).__name__}: {exc}"}
        return self.summary

    def _stop_and_write(self) -> dict:
        global _tracing
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the last step's kernels end inside the window
        window_ms = (time.perf_counter() - self._start_s) * 1e3
        self._profile.stop()
        _tracing = False
        self.summary = summarize(self._profile.events(), self.steps_seen, window_ms, self.name)
        self._write()
        return self.summary

    def _begin(self) -> None:
        global _tracing
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profile = profile(activities=activities)
        self._profile.start()
        _tracing = True
        self._start_s = time.perf_counter()

    def _write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        raw = self.out_dir / f"{self.name}.trace.json"
        self._profile.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        (self.out_dir / f"{self.name}.summary.json").write_text(json.dumps(self.summary, indent=1))


def summarize(events, num_steps: int, window_ms: float, name: str) -> dict:
    """Per step (ms): the window, each region's host time, the device's busy time and kernel time, and
    the largest host ops (self time) and kernels."""
    per_step = 1.0 / max(num_steps, 1)
    regions, spans, host_ops, kernels, intervals = Counter(), Counter(), Counter(), Counter(), []
    for event in events:
        us = event.time_range.elapsed_us()
        region = event.name[len(REGION_PREFIX):] if event.name.startswith(REGION_PREFIX) else None
        if event.device_type == DeviceType.CUDA and region is not None:
            spans[region] += us  # the profiler's device-side mark of a region: its kernels' first start to last end
        elif event.device_type == DeviceType.CUDA:
            kernels[event.name[:100]] += us
            intervals.append((event.time_range.start, event.time_range.end))
        elif region is not None:
            regions[region] += us
        else:
            host_ops[event.name[:100]] += event.self_cpu_time_total
    ms = lambda us: round(us * per_step / 1e3, 3)  # noqa: E731 (per step, in ms)
    return {"name": name, "steps": num_steps, "window_ms_per_step": round(window_ms * per_step, 3),
            "region_ms_per_step": {k: ms(v) for k, v in regions.most_common()},
            # The regions do not nest: the rest of the window is the loop's own (waiting for work included).
            "outside_regions_ms_per_step": round(window_ms * per_step - ms(sum(regions.values())), 3),
            # Per region, from the start of the first kernel it launched to the end of the last (kernels run
            # after the host launched them: drafting's kernels can end well after its host part).
            "region_device_span_ms_per_step": {k: ms(v) for k, v in spans.most_common()},
            "device_busy_ms_per_step": ms(busy_us(intervals)),
            "kernel_ms_per_step": ms(sum(kernels.values())),
            "top_host_ops_self_ms_per_step": {k: ms(v) for k, v in host_ops.most_common(TOP_OPS)},
            "top_kernels_ms_per_step": {k: ms(v) for k, v in kernels.most_common(TOP_OPS)}}


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: time a device ran at least one kernel."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


# ---- calls into a running engine (`ProcessEngine.call` / `AsyncEngine.call`: module-level, they pickle) ----

def start_trace(core, num_steps: int, out_dir: str, name: str) -> None:
    """Trace `core`'s next `num_steps` steps into `out_dir` (refused while another trace records)."""
    if core.trace is not None and not core.trace.done:
        raise RuntimeError("a trace of this engine is already recording")
    core.trace = StepTrace(num_steps, out_dir, name)


def trace_summary(core, stop: bool = False) -> dict | None:
    """The trace's summary once written; None while it records (`stop`: end it now, with the steps seen)."""
    if core.trace is None:
        raise RuntimeError("no trace was started on this engine")
    return core.trace.finish() if stop else core.trace.summary
