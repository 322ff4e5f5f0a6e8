"""Prefill lane deployment: prompts of many requests prefilled together, KV handed to the owners."""

import asyncio
import copy
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
from ray import serve

from controller.planner import BUSY_FRAC, PENDING_TOKENS, PREFILL_MS, PREFILL_TOKENS_PER_S
from deployments.channels.remote import PEER_CALL_TIMEOUT_S, PrefillDone, PrefillJob, replica_silent
from deployments.factories import PREFILL_BATCH_MAX
from deployments.placement.kv_transfer import HostKV, Placement, PoolHandle, PoolViews, write_all
from deployments.replicas.lane_batcher import LaneBatcher
from deployments.replicas.lane_server import LaneServer
from deployments.replicas.lane_worker import LaneWorker
from deployments.replicas.tp_workers import bind_workers, watch_workers
from deployments.routing.hedged import hedged
from deployments.routing.router_state import describe
from deployments.routing.serve_calls import own_request
from deployments.telemetry.metrics import LaneMetrics
from deployments.telemetry.slo_signals import BusyWindow, LatencyWindow
from deployments.telemetry.timeline import TIMELINE, replica_report
from lanes.device.streams import PREFILL_PRIORITY
from lanes.engine.backends import KVLost, LaneOOM
from lanes.spec.prompt_prefiller import PrefilledKV, PromptPrefiller

log = logging.getLogger(__name__)

# allocate_many answers in milliseconds (~5 ms with Ray's hop on an H200); a copy unanswered this long
# is stuck, and another is sent (deployments/routing/hedged.py).
SLOT_CALL_RESEND_S = 1.0
VIEWS_WATCH_S = 2.0  # how often the owners of opened peer pools are asked after (a dead one's memory is held)


@dataclass
class Prefilled:
    """One prompt as its batch leaves the worker thread: the reply, and what is still to be sent."""

    done: PrefillDone
    target: str  # how the target KV travels: in_place / peer / copied / none
    draft: str
    tokens: int
    target_bytes: int
    draft_bytes: int
    batch_s: float  # wall clock (timelines): the batch began, its forward ended, its KV writes ended
    forward_end_s: float
    written_s: float = 0.0
    verify_kv: HostKV | None = None  # pdv, verify lane out of reach: sent to it through the object store
    committed: asyncio.Future | None = None  # pdv in place: the verify lane taking the batch's slots


class PrefillServer(LaneServer):
    lane_name = "prefill"

    def __init__(self, prefiller_factory, mode: str, verify=None, start_workers=None):
        """`start_workers()`: starts the worker ranks of a sharded target in this replica's placement
        group (deployments/replicas/tp_workers.py); the prefiller, rank 0, is built with the address they meet at."""
        prefiller_factory, self.shard_workers = bind_workers(prefiller_factory, start_workers)
        self.prefiller: PromptPrefiller = prefiller_factory()
        self.verify = verify  # pdv: the verify lane receives the target KV from here
        self.worker = LaneWorker("prefill", self.prefiller.target.device, PREFILL_PRIORITY)
        # A worker rank that ends fails every forward at once (rank 0 would wait on it), and the health check.
        self._worker_watch = watch_workers(self.shard_workers, self.worker.lose)
        self.placement_ = Placement.here(self.prefiller.target.device)
        self.views = PoolViews()
        self.metrics = LaneMetrics("prefill", mode)
        # A batch's prompts must fit the scratch pools together (sized by the lane's memory profile).
        scratch = self.prefiller.target.pool
        self.batcher = LaneBatcher(self._forward, PREFILL_BATCH_MAX,
                                   cost=lambda job: -(-len(job.request.prompt_ids) // scratch.block_size),
                                   capacity=scratch.shape.num_blocks)
        self.pending = 0
        # The planner's signals: each prompt's time here (its part of TTFT), the prompt tokens waiting, and
        # the time spent in forwards with the tokens they prefilled.
        self.prompt_time, self.busy = LatencyWindow(), BusyWindow()
        self.pending_tokens = 0
        # Draft KV hand-overs by transport ("none": drafting by prompt lookup, there is no draft KV).
        self.handed_over = {"in_place": 0, "peer": 0, "copied": 0, "none": 0}
        # KV bytes of each model by how they went: "copied" went through Ray's object store.
        self.handed_over_bytes = {model: {"in_place": 0, "peer": 0, "copied": 0, "none": 0}
                                  for model in ("target", "draft")}
        # pdv: each verify replica's target pool (by lease) when this replica can write into it, else None.
        self._verify_pools: dict[str, PoolHandle | None] = {}
        self._verify_route_lock = asyncio.Lock()
        self._exported_prefix = (0, 0)  # prefix-cache (queries, hits) totals exported so far
        self.oom_retries = 0  # prefill batches that ran out of device memory and were retried in halves
        # allocate_many copies sent again, the first unanswered (deployments/routing/hedged.py)
        self.slot_calls_resent = 0
        self._views_watch: asyncio.Task | None = None
        self.views_dropped = 0  # views of dead replicas' pools closed

    async def placement(self) -> Placement:
        return self.placement_

    async def prefill(self, job: PrefillJob) -> PrefillDone:
        """Prefill one prompt in the next batch (calls from all decode replicas are merged)."""
        job.received_s = time.time()  # timelines: transit (sent -> received) apart from the batch queue
        if self._views_watch is None:  # started lazily, on the replica's event loop
            self._views_watch = asyncio.get_running_loop().create_task(self._drop_dead_views_forever())
        self._set_queue_depth(+1)
        self.prompt_time.begin(id(job))
        self.pending_tokens += len(job.request.prompt_ids)
        try:
            out: Prefilled = await self.batcher.submit(job)
        finally:
            self._set_queue_depth(-1)
            self.pending_tokens -= len(job.request.prompt_ids)
            self.prompt_time.drop(id(job))
        # The RPCs left run here, per request, so the next forward need not wait for them.
        if out.verify_kv is not None:
            loading = asyncio.ensure_future(own_request(self.verify.load_kv, out.verify_kv, job.owner))
            try:
                out.done.target_lease, out.done.target_slot = await asyncio.wait_for(asyncio.shield(loading),
                                                                                    PEER_CALL_TIMEOUT_S)
            except TimeoutError as exc:
                # A verify replica slow to take it (its worker queued behind forwards on a busy host):
                # the request is recomputed (bounded by max_migrations), not failed, and a slot that
                # is taken late is freed.
                asyncio.ensure_future(self._release_once_settled(loading))
                raise KVLost(f"no verify replica took the prompt's KV in {PEER_CALL_TIMEOUT_S:g} s") from exc
        elif out.committed is not None:
            try:
                await asyncio.wait_for(asyncio.shield(out.committed), PEER_CALL_TIMEOUT_S)
            except TimeoutError as exc:
                # The decode replica never learns this slot (it recomputes the request elsewhere): a
                # verify replica that answers late must not keep it.
                asyncio.ensure_future(self._release_once_settled(out.committed, out.done.target_lease,
                                                                  out.done.target_slot))
                raise replica_silent(out.done.target_lease) from exc
        self.handed_over[out.draft] += 1
        self.handed_over_bytes["target"][out.target] += out.target_bytes
        self.handed_over_bytes["draft"][out.draft] += out.draft_bytes
        self.prompt_time.add(1e3 * (time.time() - job.received_s))
        TIMELINE.record("handover", out.forward_end_s, time.time(), tokens=out.tokens, target=out.target,
                        draft=out.draft, target_bytes=out.target_bytes, draft_bytes=out.draft_bytes, sent_s=job.sent_s,
                        received_s=job.received_s, batch_s=out.batch_s, written_s=out.written_s)
        return out.done

    async def _release_once_settled(self, call: asyncio.Future, lease: str | None = None,
                                    slot: int | None = None) -> None:
        """Free the verify slot of a call that did not answer in time, once it settles: a commit of the
        known `lease`'s `slot`, or a `load_kv`, which returns the lease and slot it took. After the call,
        not before (a release that overtook it would leave the slot's owner recorded on a free slot)."""
        await asyncio.wait([call])
        if call.cancelled() or call.exception() is not None:
            return  # nothing held: the replica is gone, with its pool
        if slot is None:
            lease, slot = call.result()
        try:
            await own_request(self.verify.release, [slot], lease=lease)
        except Exception as exc:  # noqa: BLE001 - it went since: its pool with it
            log.info("release of a verify slot taken after its call timed out failed: %s", exc)

    async def _forward(self, jobs: list[PrefillJob]) -> list[Prefilled]:
        """One batch's prefill and hand-over; where its forwards run out of device memory (other work on
        the GPU took it), each half apart, down to one prompt, whose error (LaneOOM) has its decode
        replica recompute it (a bounded number of times: EngineConfig.max_oom_attempts)."""
        try:
            return await self._forward_batch(jobs)
        except torch.OutOfMemoryError as exc:
            self.oom_retries += 1
            self.metrics.record_oom_recoveries(1)
            log.warning("prefill: out of device memory in a batch of %d prompts; retrying in halves: %s",
                        len(jobs), exc)
            if len(jobs) == 1:
                raise LaneOOM("the prefill lane ran out of device memory for this prompt") from None
            half = len(jobs) // 2
            return await self._forward(jobs[:half]) + await self._forward(jobs[half:])

    async def _forward_batch(self, jobs: list[PrefillJob]) -> list[Prefilled]:
        batch_s = time.time()
        # The verify lane's slots are asked for while the forward runs.
        forward, leased = await asyncio.gather(self.worker.run(self._prefill_timed, [j.request for j in jobs]),
                                               self._verify_slots([len(j.request.prompt_ids) for j in jobs]),
                                               return_exceptions=True)
        if isinstance(forward, BaseException) or isinstance(leased, BaseException):
            if isinstance(leased, tuple):
                own_request(self.verify.release, leased[1], lease=leased[0])
            if not isinstance(forward, BaseException):
                await self.worker.run(forward[1])
            raise forward if isinstance(forward, BaseException) else leased
        lease, slots, blocks, pool = leased if leased is not None else (None, None, None, None)
        kvs, release, forward_ms = forward
        self.metrics.observe_step(forward_ms, len(jobs))
        self.busy.add(forward_ms / 1e3, sum(len(j.request.prompt_ids) for j in jobs))
        self._export_prefix_cache()
        # The KV writes run next on the same thread and stream, before any other batch's forward,
        # straight from the scratch slots (views, released after), in one job: queued one by one,
        # each would wait behind the next batch's forward.
        outs = await self.worker.run(self._write_out, jobs, kvs, release, (pool, slots, blocks), (batch_s, time.time()))
        for out in outs:
            out.done.target_lease = lease if slots is not None else None
        if slots is not None:
            committed = asyncio.ensure_future(own_request(
                self.verify.commit_many, slots, [kv.target_kv.shape[3] for kv in kvs], [j.owner for j in jobs],
                lease=lease))
            for out in outs:
                out.committed = committed
        return outs

    def _prefill_timed(self, requests) -> tuple[list[PrefilledKV], Callable[[], None], float]:
        start = time.perf_counter()
        kvs, release = TIMELINE.timed("prefill", self.prefiller.prefill_in_scratch, rows=len(requests),
                                      tokens=sum(len(r.prompt_ids) for r in requests))(requests)
        return kvs, release, (time.perf_counter() - start) * 1e3

    def _write_out(self, jobs: list[PrefillJob], kvs: list[PrefilledKV], release: Callable[[], None],
                   verify: tuple[PoolHandle | None, list[int] | None, list[list[int]] | None],
                   times_s: tuple[float, float]) -> list[Prefilled]:
        """Each prompt's KV into its owners' pools where this replica can reach them, else to the host;
        `verify`: the verify replica's pool, the slots it gave this batch and their blocks (pdv in place)."""
        try:
            return self._write_each(jobs, kvs, verify, times_s)
        finally:
            release()  # every copy out of the scratch slots has finished (write_all waits; HostKV reads to the host)

    def _write_each(self, jobs, kvs, verify, times_s) -> list[Prefilled]:
        verify_pool, verify_slots, verify_blocks = verify
        outs, writes, labels = [], [], []
        for i, (job, kv) in enumerate(zip(jobs, kvs)):
            out = Prefilled(PrefillDone(kv.first_token, None, None, None, num_cached_tokens=kv.num_cached_tokens,
                                        logprobs=kv.logprobs, prompt_logprobs=kv.prompt_logprobs),
                            "none", "copied", kv.target_kv.shape[3],
                            _nbytes(kv.target_kv), _nbytes(kv.draft_kv), *times_s)
            if job.draft_pool is not None:
                writes.append((self.views.get(job.draft_pool), job.draft_blocks, kv.draft_kv))
                labels.append((out, "draft"))
            elif kv.draft_kv is not None:
                out.done.draft_kv = HostKV.from_tensor(kv.draft_kv)
            else:
                out.draft = "none"
            if verify_slots is not None:
                writes.append((self.views.get(verify_pool), verify_blocks[i], kv.target_kv))
                labels.append((out, "target"))
                out.done.target_slot = verify_slots[i]
            elif self.verify is not None:
                out.verify_kv, out.target = HostKV.from_tensor(kv.target_kv), "copied"
            elif job.target_pool is not None:
                writes.append((self.views.get(job.target_pool), job.target_blocks, kv.target_kv))
                labels.append((out, "target"))
            elif job.want_target_kv:
                out.done.target_kv, out.target = HostKV.from_tensor(kv.target_kv), "copied"
            outs.append(out)
        for (out, field), transport in zip(labels, write_all(writes)):
            setattr(out, field, transport)
        written_s = time.time()
        for out in outs:
            out.written_s = written_s
        return outs

    async def _verify_slots(self, lengths: list[int]) -> tuple[str, list[int], list[list[int]], PoolHandle] | None:
        """pdv: a slot per prompt (of these lengths) in a verify replica whose pool this replica can write
        into, with its lease, the slots' blocks and the pool; None where the KV goes through Ray instead."""
        if self.verify is None or (self._verify_pools and not any(self._verify_pools.values())):
            # No verify lane, or none of the replicas asked so far is in reach (across nodes, or without
            # peer access): no slots to ask for. On one node with peer access every one is in reach.
            return None
        # The least loaded verify replica gives the slots; the batch's KV, its commit and every later
        # call about these slots go to that replica (its lease).
        lease, slots, blocks = await hedged(lambda: own_request(self.verify.allocate_many, lengths),
                                            resend_after_s=SLOT_CALL_RESEND_S, deadline_s=PEER_CALL_TIMEOUT_S,
                                            discard=self._give_back, on_resend=self._slot_call_resent)
        try:
            pool = await self._verify_pool(lease)
        except BaseException as exc:
            own_request(self.verify.release, slots, lease=lease)
            if isinstance(exc, TimeoutError):
                raise replica_silent(lease) from exc
            raise
        if pool is None:  # out of reach: copy through Ray instead
            own_request(self.verify.release, slots, lease=lease)
            return None
        return lease, slots, blocks, pool

    def _slot_call_resent(self, copies: int) -> None:
        # Sent and unanswered, or never sent: this process's router for the verify lane tells which.
        self.slot_calls_resent += 1
        log.warning("allocate_many unanswered in %g s (%d copies sent; %d resends so far); sending it again. "
                    "Verify router here: %s", SLOT_CALL_RESEND_S * copies, copies, self.slot_calls_resent,
                    describe(self.verify))

    async def _give_back(self, leased: tuple[str, list[int], list[list[int]]]) -> None:
        """Free the slots of an `allocate_many` copy that answered after another one had."""
        lease, slots, _ = leased
        await own_request(self.verify.release, slots, lease=lease)

    async def _verify_pool(self, lease: str) -> PoolHandle | None:
        """The pool of verify replica `lease` if its GPU is in reach (same GPU, peer access), asked once."""
        async with self._verify_route_lock:  # batches may overlap here: ask each replica once
            if lease not in self._verify_pools:
                peer = await asyncio.wait_for(own_request(self.verify.placement, lease=lease), PEER_CALL_TIMEOUT_S)
                self._verify_pools[lease] = (
                    await asyncio.wait_for(own_request(self.verify.pool_handle, lease=lease), PEER_CALL_TIMEOUT_S)
                    if self.placement_.can_write_into(peer) else None)
        return self._verify_pools[lease]

    async def _drop_dead_views_forever(self) -> None:
        """Close the views of pools whose owner died (deployments/placement/kv_transfer.py, PoolViews): its KV
        memory comes back to the GPU for its replacement."""
        while True:
            await asyncio.sleep(VIEWS_WATCH_S)
            try:
                dead = await self.views.drop_dead()
            except Exception:  # noqa: BLE001 - the watch must outlive one failed round
                log.exception("checking the owners of opened KV pools failed")
                continue
            if dead:
                self._verify_pools = {lease: pool for lease, pool in self._verify_pools.items()
                                      if pool is None or pool.owner not in dead}
                self.views_dropped += len(dead)
                log.warning("closed the views of %d KV pools whose replicas died: %s", len(dead), ", ".join(dead))

    def _export_prefix_cache(self) -> None:
        cache = self.prefiller.prefix_cache
        if cache is not None:
            totals = cache.num_queries, cache.num_hits
            self.metrics.record_prefix_cache(totals[0] - self._exported_prefix[0], totals[1] - self._exported_prefix[1])
            self._exported_prefix = totals

    def _set_queue_depth(self, change: int) -> None:
        self.pending += change  # prompts waiting for or in a prefill forward
        self.metrics.set_queue_depth(self.pending)

    async def stats(self) -> dict:
        return {"pending": self.pending, "handed_over": dict(self.handed_over),
                "handed_over_bytes": copy.deepcopy(self.handed_over_bytes), "oom_retries": self.oom_retries,
                "verify_in_place": {lease: pool is not None for lease, pool in self._verify_pools.items()},
                "slot_calls_resent": self.slot_calls_resent, "views_dropped": self.views_dropped,
                "replica_pid": os.getpid()}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics of this replica: what the replica planner scales the lane on
        (controller/planner.py)."""
        return {PREFILL_MS: self.prompt_time.p95_ms(), PENDING_TOKENS: self.pending_tokens,
                PREFILL_TOKENS_PER_S: self.busy.work_per_busy_s(), BUSY_FRAC: self.busy.busy_frac()}

    async def timeline(self, start_s: float = 0.0, offset: int = 0) -> dict:
        """Where this replica runs, its prefill forwards and each request's KV hand-over since `start_s`."""
        return replica_report("prefill", self.placement_, start_s, offset)


def _nbytes(kv: torch.Tensor | None) -> int:
    return 0 if kv is None else kv.numel() * kv.element_size()


PrefillDeployment = serve.deployment(PrefillServer, name="PrefillLane")
