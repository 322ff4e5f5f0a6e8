"""Verify lane deployment: the target model and its KV pool; scores drafts of many requests per forward."""

import asyncio
import logging
import os
import time
from dataclasses import replace

import torch
from ray import serve
from ray.serve.config import RequestRouterConfig

from controller.planner import BUSY_FRAC, DRAFT_LEN, OCCUPANCY, PENDING_ROWS, VERIFY_MS
from deployments.channels.remote import current_actor, merge_rows
from deployments.channels.verify_channel import ChannelAddress, VerifyChannelServer
from deployments.placement.kv_transfer import HostKV, Placement, PoolHandle
from deployments.replicas.lane_batcher import LaneBatcher
from deployments.replicas.lane_server import LaneServer
from deployments.replicas.lane_worker import LaneWorker
from deployments.replicas.tp_workers import bind_workers, watch_workers
from deployments.routing.lease_router import LeaseRouter
from deployments.routing.leases import replica_lease
from deployments.routing.slot_owners import SlotOwners
from deployments.telemetry.metrics import LaneMetrics
from deployments.telemetry.slo_signals import BusyWindow, LatencyWindow
from deployments.telemetry.timeline import TIMELINE, replica_report
from lanes.device.shared_drafts import DraftRef, OpenRing, RingHandle, can_open
from lanes.device.streams import PREFILL_PRIORITY, VERIFY_PRIORITY, lane_stream, on
from lanes.engine.backends import LaneOOM
from lanes.kv.pool import PoolFullError
from lanes.model.forward_cost import forward_costs_ms
from lanes.sample.grammar import merge_bitmasks
from lanes.sample.penalties import PenaltyHistory
from lanes.spec.prompt_prefiller import PrefilledKV, PrefillRequest, PromptPrefiller
from lanes.spec.rejection import point_mass
from lanes.spec.verify import VerifyBatch, VerifyLane, VerifyResult

VERIFY_CALLS_MAX = 16  # decode replicas' calls merged into one verify forward

log = logging.getLogger(__name__)


class StaleTargetSlots(RuntimeError):
    """A call names slots that another verify replica (or a dead one) handed out."""


class VerifyServer(LaneServer):
    """Thin wrapper: forwards and KV copies run on the lane's worker thread, in call order."""

    lane_name = "verify"

    def __init__(self, lane_factory, mode: str, start_workers=None, prefill_tokens: int = 0):
        """`start_workers()`: starts the worker ranks of a sharded target in this replica's placement
        group (deployments/replicas/tp_workers.py); the lane, rank 0, is built with the address they meet at.
        `prefill_tokens`: pdv with `local_prefill_max_tokens`: the prompt tokens of one prefill forward
        here (`prefill`); 0: this replica prefills nothing."""
        lane_factory, self.shard_workers = bind_workers(lane_factory, start_workers)
        self.lane: VerifyLane = lane_factory()
        # Before serving: what the controller derives the drafter's relative cost from (lanes/model/forward_cost.py).
        self.forward_ms = forward_costs_ms({"target": self.lane.runner})
        self.worker = LaneWorker("verify", self.lane.runner.device, VERIFY_PRIORITY)
        # A worker rank that ends fails every forward at once (rank 0 would wait on it), and the health check.
        self._worker_watch = watch_workers(self.shard_workers, self.worker.lose)
        self.placement_ = Placement.here(self.lane.runner.device)
        self.metrics = LaneMetrics("verify", mode)
        self.batcher = LaneBatcher(self._forward, VERIFY_CALLS_MAX)
        self.pending_rows = 0  # rows waiting for or in a verify forward: the lane's queue depth
        # The planner's signals: each call's time here (its part of a decode step, so of TPOT), the time spent
        # in forwards, and the longest draft of the last forward (the L that costs the target's compute).
        self.call_time, self.busy = LatencyWindow(), BusyWindow()
        self.last_draft_len = 0
        # This replica's name on every slot it hands out: its Serve replica id, by which every caller
        # routes a call about those slots back here (deployments/routing/lease_router.py). A call or a release
        # that names another lease (a misrouted call, or a dead replica's slots) is refused or ignored,
        # never read from or freed in this pool.
        self.lease = replica_lease()
        self.rows_verified = 0  # rows of this replica's slots verified here
        self.stale_rows = 0  # rows refused: another replica's slots
        self.rows_shed = 0  # rows not verified for want of KV blocks (their requests are recomputed)
        self.oom_retries = 0  # verify forwards that ran out of device memory and were retried in halves
        self.stale_releases = 0  # slots of another replica whose release was ignored
        self.owners = SlotOwners(self._free_slots)
        self._channel: VerifyChannelServer | None = None  # opened when a decode engine first asks
        self.rings: dict[str, OpenRing] = {}  # decode engines' rings of drafts, mapped over their channels
        self.ring_calls = 0  # verify calls whose drafts came in a ring (stats)
        self.kv_loaded_bytes = 0  # prompt KV taken through the object store (load_kv: from another GPU or node)
        # Short prompts' target KV, prefilled here into slots of this pool (pdv's split, `prefill`): a
        # forward of at most `prefill_tokens` prompt tokens at a time, beside the verify forwards.
        self.prefiller = self.prefill_batcher = self._prefill_stream = None
        if prefill_tokens:
            self.prefiller = PromptPrefiller(self.lane.runner, None, prefill_tokens, prefix_caching=False)
            self.prefill_batcher = LaneBatcher(self._prefill_forward, VERIFY_CALLS_MAX,
                                               cost=lambda call: len(call[0].prompt_ids), capacity=prefill_tokens)
            self._prefill_stream = lane_stream(self.lane.runner.device, PREFILL_PRIORITY)
        self.prompts_prefilled = 0

    async def channel(self, lease: str | None = None) -> ChannelAddress:
        """Where a decode engine sends this replica's batches straight (deployments/channels/verify_channel.py);
        they are verified as `verify` calls are, merged with them into the same forwards."""
        self._check_lease(lease)
        if self._channel is None:
            self._channel = VerifyChannelServer(self.verify, asyncio.get_running_loop(), node_ip(),
                                                self._open_ring, self._close_ring)
        return self._channel.address

    def _open_ring(self, handle: RingHandle) -> bool:
        """Map a decode engine's ring of drafts if it is on this replica's device (lanes/device/shared_drafts.py)."""
        if not can_open(handle, self.lane.runner.device):
            return False
        try:
            self.rings[handle.ring_id] = OpenRing(handle)
        except Exception:  # noqa: BLE001 - the engine's drafts then come through the host
            log.warning("verify: could not map a decode engine's ring of drafts", exc_info=True)
            return False
        return True

    def _close_ring(self, ring_id: str) -> None:
        if (ring := self.rings.pop(ring_id, None)) is not None:
            ring.close()

    def _take_drafts(self, batch: VerifyBatch) -> VerifyBatch:
        """`batch` with its drafts copied out of the engine's ring, on the worker's stream behind the engine's
        copy into it (no host wait). Every later use of them on this loop runs on that stream too (`_forward`)."""
        ref = batch.draft_tokens
        if (ring := self.rings.get(ref.ring_id)) is None:
            raise RuntimeError(f"drafts in ring {ref.ring_id}, which this replica has not mapped (or its engine left)")
        with on(self.worker.stream):
            return replace(batch, draft_tokens=ring.take(ref))

    async def placement(self, lease: str | None = None) -> Placement:
        """Where this replica runs (`lease`: the replica asked about, for the router)."""
        self._check_lease(lease)
        return self.placement_

    async def pool_handle(self, lease: str | None = None) -> PoolHandle | None:
        """CUDA IPC handle of the target pool, for a prefill lane on the same GPU (asked once per replica);
        None where a peer cannot write a whole KV into it (a sharded target: lanes/parallel/kv_handover.py)."""
        self._check_lease(lease)
        if not self.lane.pool.in_place_writable:
            return None
        return PoolHandle.export(f"verify-{self.lease}", self.lane.pool, current_actor())

    async def allocate_many(self, lengths: list[int]) -> tuple[str, list[int], list[list[int]]]:
        """This instance's lease, a free slot per prompt of these lengths and the blocks that back
        each, for a prefill lane to write a batch of prompts into in place. Raises PoolFullError
        (nothing held) when slots or blocks run out: the decode replica queues those prompts again."""
        # On the event loop, not the worker: queued behind verify forwards (~15 ms each at 7B) every
        # in-place hand-over waited for up to two of them. It only changes host-side state (the free
        # list, and the block table under the pool's lock; release and load_kv change them from the
        # worker) and no forward reads a slot before the prefill lane has committed it.
        pool, slots = self.lane.pool, []
        try:
            for length in lengths:
                slots.append(pool.allocate())
                pool.reserve([slots[-1]], [length])
        except PoolFullError:
            for slot in slots:
                pool.free(slot)
            raise
        return self.lease, slots, [pool.slot_blocks(slot) for slot in slots]

    async def commit_many(self, slots: list[int], lengths: list[int], owners: list | None = None,
                          lease: str | None = None) -> None:
        """A prefill lane wrote these prompts' KV into `slots` in place (and waited for the copies);
        `owners`: the decode replica (actor handle) each slot's request decodes on; `lease`: the one
        `allocate_many` returned."""
        self._check_lease(lease)
        for slot, length in zip(slots, lengths):
            self.lane.pool.lengths[slot] = length  # host-side; the slot is in no batch yet (see allocate_many)
        for slot, owner in zip(slots, owners or []):
            self.owners.hold(slot, owner)

    async def load_kv(self, kv: HostKV, owner=None) -> tuple[str, int]:
        """Take a prompt's KV copied from another GPU or node; returns this instance's lease and the
        slot that now holds it."""
        def load():
            slot = self.lane.pool.allocate()
            try:
                self.lane.pool.write_slot(slot, kv.tensor(self.lane.pool.kv.device))
            except BaseException:  # out of blocks (PoolFullError): the decode replica queues the prompt again
                self.lane.pool.free(slot)
                raise
            return slot
        timed = TIMELINE.timed("load_kv", load, tokens=kv.num_tokens, bytes=kv.nbytes)
        slot = await self.worker.run(timed)
        self.kv_loaded_bytes += kv.nbytes
        self.owners.hold(slot, owner)
        return self.lease, slot

    async def prefill(self, request: PrefillRequest, owner=None) -> tuple[str, int, PrefilledKV]:
        """pdv's split (lanes/engine/split_prefill.py): a short prompt's target KV prefilled into a slot of
        this replica's pool, which the caller's request then decodes with. Returns the slot's lease and
        number and the first token (sampled as the prefill lane samples it, so a seeded request gives the
        same output whichever lane prefilled it). Prompts that arrive together share a forward, on a
        stream below verify's. Raises PoolFullError (nothing held) where the pool is full (for every
        prompt of that forward: the decode replicas queue them again),
        LaneOOM where the forward ran out of device memory (the decode replica recomputes the request)."""
        if self.prefiller is None:
            raise RuntimeError("this verify replica prefills no prompts (local_prefill_max_tokens is 0)")
        return await self.prefill_batcher.submit((request, owner))

    async def _prefill_forward(self, calls: list[tuple[PrefillRequest, object]]) -> list:
        """Launch the prompts' forwards from the worker (which alone touches the pool and the runner) on
        a stream below verify's, and wait for them off it: verify forwards launched meanwhile overtake
        them on the device, as the engine's own chunks on its prefill stream (lanes/engine/backends.py).
        Run on the worker's stream, each one held every verify call queued behind it: on one H200, 2.5 ms
        more of a 24 ms pdv cycle spent in the verify replica outside its forwards, and pdv 3 % slower
        despite a 60 ms shorter TTFT (docs/lanes_one_gpu.md)."""
        requests = [request for request, _ in calls]
        tokens = sum(len(r.prompt_ids) for r in requests)
        start_s = time.time()

        def launch():
            with on(self._prefill_stream):
                return self.prefiller.launch_in_place(requests)
        try:
            launched = await self.worker.run(launch)
        except torch.OutOfMemoryError as exc:
            self.oom_retries += 1
            self.metrics.record_oom_recoveries(1)
            log.warning("verify: out of device memory prefilling %d prompts: %s", len(requests), exc)
            raise LaneOOM("the verify lane ran out of device memory prefilling this prompt") from None
        try:
            done = await asyncio.to_thread(self.prefiller.collect, launched)
        except BaseException:
            await self._free_slots(launched.slots)
            raise
        TIMELINE.record("prefill", start_s, time.time(), rows=len(requests), tokens=tokens)
        self.prompts_prefilled += len(requests)
        results = []
        for (slot, kv), (_, owner) in zip(done, calls):
            self.owners.hold(slot, owner)
            results.append((self.lease, slot, kv))
        return results

    async def release(self, slots: list[int], lease: str | None = None) -> None:
        """Free slots that this replica handed out under `lease`."""
        if lease is not None and lease != self.lease:
            log.info("ignored the release of %d slots handed out by another verify replica", len(slots))
            self.stale_releases += len(slots)
            return
        await self._free_slots(slots)

    async def _free_slots(self, slots: list[int]) -> None:
        for slot in slots:
            self.owners.drop(slot)

        def free():
            for slot in slots:
                self.lane.pool.free(slot)
        await self.worker.run(free)

    async def verify(self, batch: VerifyBatch, lease: str | None = None) -> VerifyResult:
        """One decode replica's drafts of this replica's slots (`lease`: this replica, for the router);
        calls waiting together are merged into ONE target forward."""
        rows = len(batch.target_slots)
        stale = sum(row_lease != self.lease for row_lease in batch.target_leases or [])
        if stale:
            self.stale_rows += stale
            raise StaleTargetSlots(f"{stale} of {rows} rows hold KV slots of another verify replica, or of one "
                                   "that is gone")
        if isinstance(batch.draft_tokens, DraftRef):  # sent over a channel, in the engine's ring
            batch = self._take_drafts(batch)
            self.ring_calls += 1
        self._set_queue_depth(rows)
        arrive_s = time.time()
        try:
            result = await self.batcher.submit(batch)
            # The call's time here, forward included: the rest of the caller's wait is transit and hand-offs.
            TIMELINE.record("verify_call", arrive_s, time.time(), rows=rows)
            self.call_time.add(1e3 * (time.time() - arrive_s))
            self.rows_verified += rows - sum(error is not None for error in result.errors or [])  # less those shed
            return result
        finally:
            self._set_queue_depth(-rows)

    async def _forward(self, batches: list[VerifyBatch]) -> list[VerifyResult]:
        with on(self.worker.stream):  # drafts taken from a ring are ordered on the worker's stream
            merged = merge_batches(batches)
        start = time.perf_counter()
        rows = len(merged.target_slots)
        timed = TIMELINE.timed("verify", self.lane.verify, rows=rows, calls=len(batches))
        fit = self.lane.rows_that_fit(merged)
        if len(fit) == rows:
            result = await self._verify_in_halves_on_oom(timed, merged)
        else:  # out of blocks for some rows: verify the rest, and have the decode replicas recompute these
            kept = set(fit)
            shed = [row for row in range(rows) if row not in kept]
            self.rows_shed += len(shed)
            log.info("verify: %d of %d rows shed, no free KV blocks for their drafts", len(shed), rows)
            parts = [(shed, PoolFullError(f"no free KV blocks for this row's drafts ({len(shed)} of {rows} "
                                          "rows shed)"))]
            if fit:
                with on(self.worker.stream):
                    kept_rows = merged.select(fit)
                parts.append((fit, await self._verify_in_halves_on_oom(timed, kept_rows)))
            result = merge_rows(rows, parts)
        self.metrics.observe_step((time.perf_counter() - start) * 1e3, rows)
        self.busy.add(time.perf_counter() - start, rows)
        self.last_draft_len = max(merged.num_draft, default=0)
        pool = self.lane.pool
        self.metrics.set_kv_slots(pool.num_used, pool.shape.num_slots, "target")
        self.metrics.set_kv_blocks(pool.shape.num_blocks - pool.num_free_blocks, pool.shape.num_blocks, "target")
        return split_result(result, [len(b.target_slots) for b in batches])

    async def _verify_in_halves_on_oom(self, timed, batch: VerifyBatch) -> VerifyResult:
        """Verify `batch`; where its forward runs out of device memory (other work on the GPU took it),
        verify each half apart, down to one row, whose error (LaneOOM) has its decode replica recompute it.
        Nothing of a failed forward is kept: the pool's lengths change only once a result is read."""
        try:
            return await self.worker.run(timed, batch)
        except torch.OutOfMemoryError as exc:
            self.oom_retries += 1
            self.metrics.record_oom_recoveries(1)
            rows = len(batch.target_slots)
            log.warning("verify: out of device memory in a forward of %d rows; retrying in halves: %s", rows, exc)
            if rows == 1:
                return merge_rows(1, [([0], LaneOOM("the verify lane ran out of device memory for this row"))])
            with on(self.worker.stream):
                halves = [(half, batch.select(half)) for half in (list(range(rows // 2)), list(range(rows // 2, rows)))]
            return merge_rows(rows, [(half, await self._verify_in_halves_on_oom(timed, part)) for half, part in halves])

    def _check_lease(self, lease: str | None) -> None:
        if lease is not None and lease != self.lease:
            raise StaleTargetSlots(f"a call for verify replica {lease} reached {self.lease}")

    def _set_queue_depth(self, change_rows: int) -> None:
        self.pending_rows += change_rows  # rows waiting for or in a verify forward
        self.metrics.set_queue_depth(self.pending_rows)

    async def stats(self) -> dict:
        return {"kv_slots_used": self.lane.pool.num_used, "kv_slots_total": self.lane.pool.shape.num_slots,
                "kv_blocks_free": self.lane.pool.num_free_blocks, "kv_blocks_total": self.lane.pool.shape.num_blocks,
                "pending_rows": self.pending_rows, "slots_reclaimed": self.owners.num_reclaimed,
                "replica_pid": os.getpid(), "lease": self.lease, "rows_verified": self.rows_verified,
                "stale_rows": self.stale_rows, "stale_releases": self.stale_releases, "rows_shed": self.rows_shed,
                "oom_retries": self.oom_retries, "forward_ms": self.forward_ms,
                "channel_calls": self._channel.num_calls if self._channel is not None else 0,
                "ring_calls": self.ring_calls, "rings_mapped": len(self.rings), "kv_loaded_bytes": self.kv_loaded_bytes,
                "prompts_prefilled": self.prompts_prefilled}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics of this replica: what the replica planner scales the lane on
        (controller/planner.py)."""
        pool = self.lane.pool
        return {VERIFY_MS: self.call_time.p95_ms(), PENDING_ROWS: self.pending_rows,
                OCCUPANCY: pool.num_used / pool.shape.num_slots if pool.shape.num_slots else 0.0,
                BUSY_FRAC: self.busy.busy_frac(), DRAFT_LEN: self.last_draft_len}

    async def timeline(self, start_s: float = 0.0, offset: int = 0) -> dict:
        """Where this replica runs and its verify / load_kv intervals since `start_s`
        (deployments/telemetry/timeline.py)."""
        return replica_report("verify", self.placement_, start_s, offset)


def node_ip() -> str:
    """This node's address, which the decode engines of other nodes reach too (loopback outside Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def merge_batches(batches: list[VerifyBatch]) -> VerifyBatch:
    if len(batches) == 1:
        return batches[0]
    width = max(b.draft_tokens.shape[1] for b in batches)
    with_probs = [b.draft_probs for b in batches if b.draft_probs is not None]
    vocab = with_probs[0].shape[-1] if with_probs else 0

    def pad(t: torch.Tensor, probs: bool) -> torch.Tensor:
        shape = (t.shape[0], width, vocab) if probs else (t.shape[0], width)
        out = t.new_zeros(shape)
        out[:, : t.shape[1]] = t
        return out

    def probs_of(b: VerifyBatch) -> torch.Tensor:
        # A greedy or prompt-lookup batch sent no probabilities: its q is one-hot at each drafted token.
        q = b.draft_probs if b.draft_probs is not None else point_mass(b.draft_tokens, vocab, with_probs[0].dtype)
        return pad(q, True)

    return VerifyBatch(
        target_slots=sum((b.target_slots for b in batches), []),
        num_tokens=sum((b.num_tokens for b in batches), []),
        last_tokens=sum((b.last_tokens for b in batches), []),
        draft_tokens=torch.cat([pad(b.draft_tokens, False) for b in batches]),
        draft_probs=torch.cat([probs_of(b) for b in batches]) if with_probs else None,
        num_draft=sum((b.num_draft for b in batches), []),
        params=sum((b.params for b in batches), []),
        seeds=sum((b.seeds for b in batches), []),
        history=PenaltyHistory.merge([b.history for b in batches], [len(b.target_slots) for b in batches]),
        token_bitmask=merge_bitmasks([b.token_bitmask for b in batches], [len(b.target_slots) for b in batches],
                                     width + 1),
    )


def split_result(result: VerifyResult, rows: list[int]) -> list[VerifyResult]:
    out, start = [], 0
    for n in rows:
        part = slice(start, start + n)
        errors = None if result.errors is None else result.errors[part]
        out.append(VerifyResult(result.tokens[part], result.num_accepted[part],
                                None if result.logprobs is None else result.logprobs[part],
                                errors if errors is not None and any(e is not None for e in errors) else None))
        start += n
    return out


# Every handle to this deployment routes a call that names a lease to the replica that owns it.
VerifyDeployment = serve.deployment(VerifyServer, name="VerifyLane",
                                    request_router_config=RequestRouterConfig(request_router_class=LeaseRouter))
