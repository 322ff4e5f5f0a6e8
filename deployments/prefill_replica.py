"""Prefill lane deployment: prompts of many requests prefilled together, KV handed to the owners."""

import asyncio
import time

import torch
from ray import serve

from deployments.kv_transfer import HostKV, Placement, PoolViews, write_into
from deployments.factories import PREFILL_BATCH_MAX
from deployments.lane_worker import LaneWorker
from lanes.streams import PREFILL_PRIORITY
from deployments.metrics import LaneMetrics
from deployments.remote import PrefillDone, PrefillJob
from deployments.timeline import TIMELINE, replica_report
from lanes.prompt_prefiller import PrefilledKV, PromptPrefiller


class PrefillServer:
    def __init__(self, prefiller_factory, mode: str, verify=None):
        self.prefiller: PromptPrefiller = prefiller_factory()
        self.verify = verify  # pdv: the verify lane receives the target KV from here
        self.worker = LaneWorker("prefill", self.prefiller.target.device, PREFILL_PRIORITY)
        self.placement_ = Placement.here(self.prefiller.target.device)
        self.views = PoolViews()
        self.metrics = LaneMetrics("prefill", mode)
        self.pending = 0
        self.handed_over = {"in_place": 0, "peer": 0, "copied": 0}  # draft KV hand-overs by transport
        self._verify_in_place: bool | None = None
        self._verify_pool = None
        self._verify_route_lock = asyncio.Lock()

    async def placement(self) -> Placement:
        return self.placement_

    @serve.batch(max_batch_size=PREFILL_BATCH_MAX, batch_wait_timeout_s=0.002)
    async def prefill(self, jobs: list[PrefillJob]) -> list[PrefillDone]:
        """Prefill a batch of prompts; concurrent calls from all decode replicas are merged."""
        self.pending += len(jobs)
        self.metrics.set_queue_depth(self.pending)
        try:
            start, batch_s = time.perf_counter(), time.time()
            tokens = sum(len(j.request.prompt_ids) for j in jobs)
            kvs = await self.worker.run(TIMELINE.timed("prefill", self.prefiller.prefill, rows=len(jobs), tokens=tokens),
                                        [j.request for j in jobs])
            self.metrics.observe_step((time.perf_counter() - start) * 1e3, len(jobs))
            # Concurrently: one request's RPCs and object-store transfer overlap the next one's copy.
            return list(await asyncio.gather(*(self._hand_over(job, kv, batch_s) for job, kv in zip(jobs, kvs))))
        finally:
            self.pending -= len(jobs)
            self.metrics.set_queue_depth(self.pending)

    async def stats(self) -> dict:
        return {"pending": self.pending, "handed_over": dict(self.handed_over),
                "verify_in_place": self._verify_in_place}

    async def timeline(self, start_s: float = 0.0, offset: int = 0) -> dict:
        """Where this replica runs, its prefill forwards and each request's KV hand-over since `start_s`."""
        return replica_report("prefill", self.placement_, start_s, offset)

    async def _hand_over(self, job: PrefillJob, kv: PrefilledKV, batch_s: float) -> PrefillDone:
        start_s, target, draft = time.time(), "none", "copied"
        done = PrefillDone(kv.first_token, None, None, None)
        if job.draft_pool is not None:
            draft = await self.worker.run(self._write_in_place, job.draft_pool, job.draft_slot, kv.draft_kv)
        elif kv.draft_kv is not None:
            done.draft_kv = await self.worker.run(HostKV.from_tensor, kv.draft_kv)
        if self.verify is not None:
            done.target_slot, target = await self._to_verify(kv.target_kv)
        elif job.target_pool is not None:
            target = await self.worker.run(self._write_in_place, job.target_pool, job.target_slot, kv.target_kv)
        elif job.want_target_kv:
            done.target_kv = await self.worker.run(HostKV.from_tensor, kv.target_kv)
            target = "copied"
        self.handed_over[draft] += 1
        TIMELINE.record("handover", start_s, time.time(), tokens=kv.target_kv.shape[3], target=target, draft=draft,
                        target_bytes=_nbytes(kv.target_kv), draft_bytes=_nbytes(kv.draft_kv),
                        sent_s=job.sent_s, batch_s=batch_s)
        return done

    async def _to_verify(self, target_kv: torch.Tensor) -> tuple[int, str]:
        """The verify lane's slot now holding the prompt's target KV, and how the KV got there."""
        async with self._verify_route_lock:  # hand-overs run concurrently: ask the verify lane once
            if self._verify_in_place is None:
                peer = await self.verify.placement.remote()
                if self.placement_.can_write_into(peer):
                    self._verify_pool = await self.verify.pool_handle.remote()
                self._verify_in_place = self._verify_pool is not None
        if not self._verify_in_place:
            # A real copy, via the object store. Read to the host on the worker thread: its stream
            # is the one the prefill wrote the KV on, so the copy is ordered after those writes.
            kv = await self.worker.run(HostKV.from_tensor, target_kv)
            return await self.verify.load_kv.remote(kv), "copied"
        slot = await self.verify.allocate.remote()
        transport = await self.worker.run(self._write_in_place, self._verify_pool, slot, target_kv)
        await self.verify.commit.remote(slot, target_kv.shape[3])
        return slot, transport

    def _write_in_place(self, handle, slot: int, kv: torch.Tensor) -> str:
        return write_into(self.views.get(handle), slot, kv)


def _nbytes(kv: torch.Tensor | None) -> int:
    return 0 if kv is None else kv.numel() * kv.element_size()


PrefillDeployment = serve.deployment(PrefillServer, name="PrefillLane")
