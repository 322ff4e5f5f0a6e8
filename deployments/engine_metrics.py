"""What the decode-lane replica exports after every engine step (Ray metrics), and the rolling
window of step times that its stats() reports to the controller."""

from collections import deque

from deployments.metrics import LaneMetrics
from lanes.engine_core import EngineCore
from lanes.spec_stats import SpecDecodeStats

STEP_WINDOW = 256  # recent steps kept for the p95 the controller reads
GPU_SAMPLE_EVERY = 50  # steps between two GPU utilisation readings (NVML calls are not free)


class EngineMetrics:
    def __init__(self, lane: str, mode: str):
        self.metrics = LaneMetrics(lane, mode)
        self.step_ms: deque[float] = deque(maxlen=STEP_WINDOW)
        self._exported = SpecDecodeStats()
        self._steps = 0

    def on_step(self, core: EngineCore, step_ms: float, batch_size: int) -> None:
        self.step_ms.append(step_ms)
        self.metrics.observe_step(step_ms, batch_size)
        sched = core.scheduler
        self.metrics.set_queue_depth(len(sched.waiting) + len(sched.prefilling))
        if sched.draft_pool is not None:
            self.metrics.set_kv_slots(sched.draft_pool.num_used, sched.draft_pool.shape.num_slots, "draft")
        target_pool = getattr(core.verifier, "pool", None)
        if target_pool is not None:
            self.metrics.set_kv_slots(target_pool.num_used, target_pool.shape.num_slots, "target")
        self.metrics.set_draft_length(core.default_draft_len)
        for seq in sched.running:
            self.metrics.observe_request_draft_length(seq.draft_len)
        self._export_spec(core.total_stats)
        self._steps += 1
        if self._steps % GPU_SAMPLE_EVERY == 1:
            self.metrics.sample_gpu()

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
        if not self.step_ms:
            return None
        ordered = sorted(self.step_ms)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
