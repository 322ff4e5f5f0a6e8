"""When requests are sent: open-loop arrivals at a rate, or a fixed number in flight.

Open loop sends on a schedule whatever the server does (the way users arrive), so an overloaded
server shows up as queueing in TTFT rather than as a lower send rate. Gaps are gamma-distributed
with shape = burstiness and mean 1 / rate, as in `vllm bench serve`: burstiness 1 is a Poisson
process, below 1 burstier, above 1 more regular. Closed loop keeps `concurrency` requests in
flight, each sent as soon as one finishes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class OpenLoop:
    rate_rps: float  # mean requests per second; math.inf sends every request at once
    burstiness: float = 1.0  # gamma shape: 1 = Poisson

    def __post_init__(self):
        if self.rate_rps <= 0 or self.burstiness <= 0:
            raise ValueError(f"rate and burstiness must be > 0: {self}")

    def gaps_s(self, rng: np.random.Generator) -> Iterator[float]:
        """Endless gaps in seconds between one request and the next."""
        if math.isinf(self.rate_rps):
            while True:
                yield 0.0
        scale_s = 1.0 / (self.rate_rps * self.burstiness)
        while True:
            yield float(rng.gamma(shape=self.burstiness, scale=scale_s))

    @property
    def label(self) -> str:
        return f"rate={self.rate_rps:g}" + (f",burst={self.burstiness:g}"
                                            if self.burstiness != 1.0 else "")

    @property
    def load(self) -> float:
        """The load axis of sweep plots: offered requests per second."""
        return self.rate_rps


@dataclass(frozen=True)
class ClosedLoop:
    concurrency: int

    def __post_init__(self):
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    @property
    def label(self) -> str:
        return f"concurrency={self.concurrency}"

    @property
    def load(self) -> float:
        """The load axis of sweep plots: requests in flight."""
        return float(self.concurrency)


@dataclass(frozen=True)
class RampLoop:
    """Open-loop Poisson arrivals whose rate follows a piecewise-linear schedule: `points` of (seconds since
    the start, requests per second), the rate held at the last point's after it. A load that rises and
    falls within one run, for autoscaling (benchmarks/planner_ramp.py)."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self):
        times = [t for t, _ in self.points]
        if not self.points or times[0] != 0 or times != sorted(times) or min(r for _, r in self.points) <= 0:
            raise ValueError(f"a ramp starts at 0 s, goes forward in time and keeps every rate > 0: {self.points}")

    def rate_at(self, t_s: float) -> float:
        for (t0, r0), (t1, r1) in zip(self.points, self.points[1:]):
            if t0 <= t_s < t1:
                return r0 + (r1 - r0) * (t_s - t0) / (t1 - t0)
        return self.points[-1][1]

    def gaps_s(self, rng: np.random.Generator, dt_s: float = 0.01) -> Iterator[float]:
        """Endless gaps: each spans an Exp(1) amount of the schedule's integrated rate (inversion, in steps
        of `dt_s` over which the rate is taken as constant)."""
        t_s = 0.0
        while True:
            start_s, need = t_s, float(rng.exponential())
            while need > 0:
                step = self.rate_at(t_s) * dt_s
                if step >= need:
                    t_s += dt_s * need / step
                    need = 0.0
                else:
                    t_s, need = t_s + dt_s, need - step
            yield t_s - start_s

    @property
    def label(self) -> str:
        return "ramp=" + ",".join(f"{t:g}s:{r:g}" for t, r in self.points)

    @property
    def load(self) -> float:
        """The load axis of sweep plots: the peak rate."""
        return max(r for _, r in self.points)


Arrivals = OpenLoop | ClosedLoop | RampLoop
