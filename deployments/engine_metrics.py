"""What the decode-lane replica exports after every engine step (Ray metrics), and the recent
step times whose p95 its stats() reports to the controller."""

import time
from collections import deque

from deployments.metrics import LaneMetrics
from lanes.engine_core import EngineCore
from lanes.spec_stats import SpecDecodeStats

STEP_WINDOW_S = 10.0  # the p95 covers the steps of the last 10 s: an idle lane reports none
GAUGE_REFRESH_S = 1.0  # while idle, gauges are re-set this often (Ray drops gauges nobody sets)


class EngineMetrics:
    def __init__(self, lane: str, mode: str):
        self.metrics = LaneMetrics(lane, mode)
        self._steps: deque[tuple[float, float]] = deque()  # (monotonic time s, step time ms)
        self._exported = SpecDecodeStats()
        self._gauges_set_at_s = 0.0

    def on_step(self, core: EngineCore, step_ms: float, batch_size: int) -> None:
        """After every engine step, on the engine thread."""
        self._steps.append((time.monotonic(), step_ms))
        self.metrics.observe_step(step_ms, batch_size)  # also samples the GPU now and then
        for seq in core.scheduler.running:
            self.metrics.observe_request_draft_length(seq.draft_len)
        self._export_spec(core.total_stats)
        self._set_gauges(core)

    def on_idle(self, core: EngineCore) -> None:
        """While the engine has nothing to do, so that idle lanes read 0, not 'no data'."""
        if time.monotonic() - self._gauges_set_at_s >= GAUGE_REFRESH_S:
            self._set_gauges(core)

    def _set_gauges(self, core: EngineCore) -> None:
        self._gauges_set_at_s = time.monotonic()
        sched = core.scheduler
        self.metrics.set_queue_depth(len(sched.waiting) + len(sched.prefilling))
        if sched.draft_pool is not None:
            self.metrics.set_kv_slots(sched.draft_pool.num_used, sched.draft_pool.shape.num_slots, "draft")
        target_pool = getattr(core.verifier, "pool", None)
        if target_pool is not None:
            self.metrics.set_kv_slots(target_pool.num_used, target_pool.shape.num_slots, "target")
        self.metrics.set_draft_length(core.default_draft_len)

    def _export_spec(self, total: SpecDecodeStats) -> None:
        # Ray counters take increments: export what changed since the last step.
        done = self._exported
        per_pos = total.accepted_per_pos + [0] * (len(done.accepted_per_pos) - len(total.accepted_per_pos))
        delta_pos = [t - (done.accepted_per_pos[i] if i < len(done.accepted_per_pos) else 0)
                     for i, t in enumerate(per_pos)]
        self.metrics.record_spec(total.num_drafts - done.num_drafts, total.num_draft_tokens - done.num_draft_tokens,
                                 total.num_accepted_tokens - done.num_accepted_tokens, delta_pos)
        self._exported = SpecDecodeStats(total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens,
                                         list(total.accepted_per_pos))

    def step_p95_ms(self) -> float | None:
        """p95 of the steps of the last STEP_WINDOW_S seconds (None when the lane was idle)."""
        horizon = time.monotonic() - STEP_WINDOW_S
        while self._steps and self._steps[0][0] < horizon:
            self._steps.popleft()
        if not self._steps:
            return None
        ordered = sorted(ms for _, ms in self._steps)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
