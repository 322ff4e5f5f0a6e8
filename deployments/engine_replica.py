"""Decode lane deployment (pd, pdv), or the whole engine in one replica (unified, spec, nospec)."""

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve

from deployments.engine_metrics import EngineMetrics
from deployments.kv_transfer import Placement
from deployments.timeline import TIMELINE, replica_report
from lanes.async_engine import AsyncEngine
from lanes.outputs import RequestOutput
from lanes.params import ParamError, SamplingParams
from lanes.sequence import Sequence

log = logging.getLogger(__name__)

# The engine thread drops the GIL in every torch call and at every wait on the GPU, and must then
# win it back from the replica's event-loop and serialisation threads, which may keep it for up to
# the switch interval (Python's default: 5 ms) each time. 0.5 ms bounds each such wait. On the CPU
# machine it moved served nospec from 0.67-0.70 to 0.75 of in process (docs/performance.md); its
# effect on a GPU step is not measured yet.
ENGINE_SWITCH_INTERVAL_S = 0.0005


@dataclass
class GenerateError:
    """A request the engine refused; yielded as a value so that the stream ends cleanly."""

    status: int
    message: str
    param: str | None = None


class EngineServer:
    def __init__(self, engine_factory, mode: str, prefill=None, verify=None, stream_interval_s: float = 0.0,
                 max_stream_messages_per_s: float | None = None):
        # Serve runs the constructor on the replica's event loop; remote lanes are reached through it.
        loop = asyncio.get_event_loop()
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
        # In the one-replica modes this replica is all three lanes; in pd and pdv it is the decode lane.
        self.lane = "decode" if mode in ("pd", "pdv") else "engine"
        self.metrics = EngineMetrics(self.lane, mode)
        core = engine_factory(loop=loop, prefill=prefill, verify=verify)
        # The draft runner's device, or the target's where there is no draft (nospec).
        device = core.draft.device if core.draft is not None else core.verifier.pool.kv.device
        self.placement_ = Placement.here(device)
        self.engine = AsyncEngine(core, on_step=self._on_step, on_idle=self.metrics.on_idle,
                                  stream_interval_s=stream_interval_s,
                                  max_stream_messages_per_s=max_stream_messages_per_s)
        self.num_arrivals = 0  # generate() calls since start; the controller turns it into a rate

    async def generate(self, prompt: list[int] | str, params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput | GenerateError]:
        """Stream a request's chunks. Cancelling the call (client gone) aborts it and frees its slots."""
        self.num_arrivals += 1
        try:
            async for out in self.engine.generate(prompt, params, request_id):
                yield out
        except ParamError as exc:
            yield GenerateError(400, str(exc), exc.field)

    async def set_draft_lengths(self, default_len: int, per_request: dict[str, int] | None = None) -> None:
        self.engine.set_draft_lengths(default_len, per_request)

    async def stats(self) -> dict:
        """Slot usage and spec-decode totals of this replica, read between engine steps; `requests` and
        `num_arrivals` are cumulative counters the controller turns into per-interval deltas."""
        def read(core):
            s = core.scheduler
            return {
                "kv_slots_used": s.draft_pool.num_used if s.draft_pool is not None else None,
                "waiting": len(s.waiting), "prefilling": len(s.prefilling), "running": len(s.running),
                "max_num_seqs": core.config.max_num_seqs,
                "default_draft_len": core.default_draft_len,
                "spec_decode": core.total_stats.to_dict(),
                "step_p95_ms": self.metrics.step_p95_ms(),
                "step_totals": self.metrics.verify_step_totals(),
                "target_slots_used": getattr(getattr(core.verifier, "pool", None), "num_used", None),
                "num_arrivals": self.num_arrivals,
                # Engine steps and the stream messages they became (what serving_overhead.py reads).
                "num_steps": self.engine.num_steps, "num_messages": self.engine.num_messages,
                "step_ms_total": self.engine.step_ms_total, "pid": os.getpid(),
                "requests": {seq.request_id: request_counters(seq) for seq in s.by_id.values()},
            }
        return await self.engine.call(read)

    async def timeline(self, start_s: float = 0.0, offset: int = 0) -> dict:
        """Where this replica runs and its engine steps (and, in pdv, its waits on the verify lane)
        since `start_s`, one page from `offset` (deployments/timeline.py)."""
        return replica_report(self.lane, self.placement_, start_s, offset)

    def _on_step(self, core, step_ms: float, batch_size: int) -> None:
        end_s = time.time()
        TIMELINE.record("step", end_s - step_ms / 1e3, end_s, rows=batch_size)
        self.metrics.on_step(core, step_ms, batch_size)

    def __del__(self):
        self.engine.shutdown()


def request_counters(seq: Sequence) -> dict[str, int]:
    """The L a request drafts with and its spec-decode counters since it started."""
    st = seq.stats
    return {"draft_len": seq.draft_len, "num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
            "num_accepted_tokens": st.num_accepted_tokens}


EngineDeployment = serve.deployment(EngineServer, name="DecodeLane")
