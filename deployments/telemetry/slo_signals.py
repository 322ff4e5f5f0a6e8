"""What a lane replica measures of the latency it owns, for the replica planner (controller/planner.py) and
the draft-length controller: p95s over a sliding window, requests still waiting, and time spent busy."""

import time
from collections import deque

SIGNAL_WINDOW_S = 10.0  # a p95 covers the last 10 s; an idle lane reports 0
SIGNAL_WINDOW_SAMPLES = 512


class LatencyWindow:
    """Samples (ms) of the last `window_s` seconds; `p95_ms` also counts what is still waiting: a request
    queued for longer than every sample bounds the p95 from below before it yields one."""

    def __init__(self, window_s: float = SIGNAL_WINDOW_S):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=SIGNAL_WINDOW_SAMPLES)  # (monotonic s, ms)
        self._waiting: dict[object, float] = {}  # key -> monotonic s it began

    def begin(self, key: object) -> None:
        self._waiting[key] = time.monotonic()

    def end(self, key: object) -> float | None:
        """The sample of `key` (ms since `begin`), recorded; None if it never began (or ended already)."""
        started = self._waiting.pop(key, None)
        if started is None:
            return None
        ms = 1e3 * (time.monotonic() - started)
        self.add(ms)
        return ms

    def drop(self, key: object) -> None:
        self._waiting.pop(key, None)

    def add(self, ms: float) -> None:
        self._samples.append((time.monotonic(), ms))

    def p95_ms(self) -> float:
        now = time.monotonic()
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        ordered = sorted(ms for _, ms in tuple(self._samples))  # tuple(): one C call, safe beside appends
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else 0.0
        oldest = min(self._waiting.values(), default=None)
        return max(p95, 1e3 * (now - oldest)) if oldest is not None else p95


class BusyWindow:
    """The fraction of the last `window_s` seconds a worker spent in forwards, and the work it did per
    second of them."""

    def __init__(self, window_s: float = SIGNAL_WINDOW_S):
        self.window_s = window_s
        self._spans: deque[tuple[float, float, float]] = deque(maxlen=SIGNAL_WINDOW_SAMPLES)  # (end s, busy s, work)

    def add(self, busy_s: float, work: float = 0.0) -> None:
        self._spans.append((time.monotonic(), busy_s, work))

    def _recent(self) -> tuple[float, float]:
        horizon = time.monotonic() - self.window_s
        while self._spans and self._spans[0][0] < horizon:
            self._spans.popleft()
        spans = tuple(self._spans)
        return sum(b for _, b, _ in spans), sum(w for _, _, w in spans)

    def busy_frac(self) -> float:
        return min(1.0, self._recent()[0] / self.window_s)

    def work_per_busy_s(self) -> float:
        busy_s, work = self._recent()
        return work / busy_s if busy_s > 0 else 0.0
