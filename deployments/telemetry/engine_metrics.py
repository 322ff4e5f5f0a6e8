"""What the decode-lane replica exports after every engine step (Ray metrics), and what its stats()
reports to the controller: the p95 of the recent step times, and running totals of the steps that
verified a batch (the samples of the controller's step-cost model)."""

import time
import uuid
from collections import deque

from deployments.telemetry.metrics import LaneMetrics
from lanes.engine.snapshot import EngineSnapshot
from lanes.spec.stats import SpecDecodeStats

STEP_WINDOW_S = 10.0  # the p95 covers the steps of the last 10 s: an idle lane reports none
# ... and at most the last 256 of them (a p95 over 256 steps is their 13th longest). Under a light load
# steps are short, so the window shrinks to about a second: on an H200 a burst's 50 ms steps otherwise
# stayed in the p95 for 10 s after the load fell to one request, and the controller, reading them as
# saturation, kept speculation off through the short points measured then (unified at 1 in flight:
# 0.94x nospec).
STEP_WINDOW_STEPS = 256
GAUGE_REFRESH_S = 1.0  # while idle, gauges are re-set this often (Ray drops gauges nobody sets)


class EngineMetrics:
    def __init__(self, lane: str, mode: str, sample_gpu: bool = True):
        self.metrics = LaneMetrics(lane, mode, sample_gpu)
        # (monotonic time s, step time ms); appending past maxlen drops the oldest
        self._steps: deque[tuple[float, float]] = deque(maxlen=STEP_WINDOW_STEPS)
        self._exported = SpecDecodeStats()
        self._exported_prefix = (0, 0)  # prefix-cache (queries, hits) totals exported so far
        self._exported_ooms = 0  # out-of-memory recoveries exported so far
        self._exported_prompts: dict[str, int] = {}  # pd's prompts prefilled, by where, exported so far
        self._gauges_set_at_s = 0.0
        # Running totals; the controller takes deltas. The id tells it a restarted replica (whose totals
        # start again from 0) from this one.
        self._verify_steps = {"replica": uuid.uuid4().hex, "num_steps": 0, "step_ms": 0.0, "rows": 0,
                              "draft_tokens": 0, "draft_forwards": 0.0, "prefill_tokens": 0}
        self._prefill_tokens_seen = 0  # the engine's prompt tokens launched in prefill chunks, at the last step

    def on_step(self, snap: EngineSnapshot, step_ms: float, batch_size: int) -> None:
        """After every engine step (on the engine thread, or on the thread that reads an engine process)."""
        self._steps.append((time.monotonic(), step_ms))
        prefill_tokens, self._prefill_tokens_seen = snap.num_prefill_tokens - self._prefill_tokens_seen, snap.num_prefill_tokens
        if batch_size:  # a step that only prefilled says nothing about what verification costs
            self._count_verify_step(snap.total_stats, step_ms, batch_size, prefill_tokens)
        self.metrics.observe_step(step_ms, batch_size)  # also samples the GPU now and then
        for draft_len in snap.draft_lens:
            self.metrics.observe_request_draft_length(draft_len)
        self._export_spec(snap.total_stats)
        self._export_prefix_cache(snap.prefix_cache)
        self.metrics.record_oom_recoveries(snap.num_oom_recoveries - self._exported_ooms)
        self._exported_ooms = snap.num_oom_recoveries
        if snap.prompts_prefilled is not None:
            self.metrics.record_prompts_prefilled({where: n - self._exported_prompts.get(where, 0)
                                                   for where, n in snap.prompts_prefilled.items()})
            self._exported_prompts = dict(snap.prompts_prefilled)
        self._set_gauges(snap)

    def on_idle(self, snap: EngineSnapshot) -> None:
        """While the engine has nothing to do, so that idle lanes read 0, not 'no data'."""
        if time.monotonic() - self._gauges_set_at_s >= GAUGE_REFRESH_S:
            self._set_gauges(snap)

    def _set_gauges(self, snap: EngineSnapshot) -> None:
        self._gauges_set_at_s = time.monotonic()
        self.metrics.set_queue_depth(snap.queue_depth)
        if snap.draft_slots is not None:
            self.metrics.set_kv_slots(*snap.draft_slots, "draft")
        if snap.target_slots is not None:
            self.metrics.set_kv_slots(*snap.target_slots, "target")
        for model, blocks in (("draft", snap.draft_blocks), ("target", snap.target_blocks)):
            if blocks is not None:
                self.metrics.set_kv_blocks(*blocks, model)
        self.metrics.set_draft_length(snap.default_draft_len)

    def _count_verify_step(self, total: SpecDecodeStats, step_ms: float, rows: int, prefill_tokens: int) -> None:
        # Before _export_spec: the spec counters' change since the last export is this step's.
        drafts = total.num_drafts - self._exported.num_drafts
        draft_tokens = total.num_draft_tokens - self._exported.num_draft_tokens
        t = self._verify_steps
        t["num_steps"] += 1
        t["step_ms"] += step_ms
        t["rows"] += rows
        t["draft_tokens"] += draft_tokens
        t["prefill_tokens"] += prefill_tokens  # launched beside the decode step, in its wall time
        # The drafter ran max L forwards over the rows that drafted; the counters give their mean L,
        # the same number when those rows share one L.
        t["draft_forwards"] += draft_tokens / drafts if drafts else 0.0

    def verify_step_totals(self) -> dict:
        """Running totals of the steps that verified a batch: their number, wall time (ms), rows, draft
        tokens, drafter forwards and the prompt tokens prefilled beside them, with this replica's id."""
        return dict(self._verify_steps)

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

    def _export_prefix_cache(self, totals: tuple[int, int]) -> None:
        (queries, hits), (done_queries, done_hits) = totals, self._exported_prefix
        self.metrics.record_prefix_cache(queries - done_queries, hits - done_hits)
        self._exported_prefix = totals

    def step_p95_ms(self) -> float | None:
        """p95 of the last STEP_WINDOW_STEPS steps within STEP_WINDOW_S seconds (None when the lane was idle)."""
        horizon = time.monotonic() - STEP_WINDOW_S
        while self._steps and self._steps[0][0] < horizon:
            self._steps.popleft()
        # The engine thread appends as this runs on the event loop: tuple() copies the deque in one C
        # call under the GIL; a Python-level loop over it raised "deque mutated during iteration",
        # failing a stats() call (and the controller's decision that made it).
        steps = tuple(self._steps)
        if not steps:
            return None
        ordered = sorted(ms for _, ms in steps)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
