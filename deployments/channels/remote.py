"""Proxies that let the decode loop reach other lanes' replicas.

They implement lanes.engine.backends.Verifier / Prefiller. An engine on the replica's thread schedules
each remote call on the replica's event loop with run_coroutine_threadsafe (RemoteVerifier, ServeLink);
an engine in a process of its own sends it through its replica (PeerLink), but for its verify batches,
which go straight to the verify replicas (LinkedVerifier, deployments/channels/verify_channel.py). The engine
waits only where the decode step needs the answer (verification), never for prefill, whose results
are collected between steps.
"""

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
from ray.exceptions import RayActorError, RayTaskError

from deployments.channels.verify_channel import VerifyChannels
from deployments.placement.kv_transfer import HostKV, Placement, PoolHandle
from deployments.routing.serve_calls import own_request
from deployments.telemetry.timeline import TIMELINE
from lanes.engine.backends import KVLost, LaneOOM
from lanes.engine.scheduler import Scheduler
from lanes.engine.sequence import SeqStatus, Sequence
from lanes.kv.pool import KVPool, PoolFullError
from lanes.sample.grammar import first_token_bitmask, pending_compile
from lanes.sample.logprobs import TokenLogprobs
from lanes.spec.prefill import PrefillChunk
from lanes.spec.prompt_prefiller import PrefillRequest
from lanes.spec.verify import VerifyBatch, VerifyResult

log = logging.getLogger(__name__)

# A verify call or a KV hand-over call to the verify lane takes milliseconds. One that has waited
# this long is waiting for a replica that is gone (Serve's router holds calls until a replacement
# is up, ~10 s and more): fail it, so that the requests behind it end quickly instead of hanging.
PEER_CALL_TIMEOUT_S = 5.0


@dataclass
class PrefillJob:
    """What a decode replica sends to the prefill lane for one request."""

    request: PrefillRequest
    draft_slot: int | None
    draft_pool: PoolHandle | None  # set when the prefill lane can write into the decode replica's GPU
    target_slot: int | None  # set in mode pd (the decode replica owns the target pool)
    target_pool: PoolHandle | None
    # With a pool handle: the blocks (of draft_slot, target_slot) the prompt's KV goes into, in order,
    # allocated by the decode replica at admission; the prefill lane sees no block table.
    draft_blocks: list[int] | None = None
    target_blocks: list[int] | None = None
    want_target_kv: bool = False  # pd over the object store: return the target KV to the caller
    sent_s: float | None = None  # wall clock when the decode replica sent it (timelines: transit and queue)
    owner: object | None = None  # pdv: the decode replica's actor handle; the verify lane frees its slots if it dies
    received_s: float | None = None  # wall clock when the prefill lane's replica received it


@dataclass
class PrefillOrder:
    """One prompt to prefill, as the engine that will decode it describes it (no Ray in it)."""

    request: PrefillRequest
    placement: Placement  # where the engine's pools are
    draft_slot: int | None
    target_slot: int | None
    # A pool's CUDA IPC handle where it is on a GPU (the prefill lane may write into it in place), and
    # the blocks of the request's slot that its KV goes into, in order.
    draft_pool: PoolHandle | None = None
    target_pool: PoolHandle | None = None
    draft_blocks: list[int] | None = None
    target_blocks: list[int] | None = None
    holds_target: bool = False  # pd: the engine owns the target pool (pdv: the verify lane does)


@dataclass
class PrefillDone:
    first_token: int
    draft_kv: HostKV | None  # when it travelled by copy
    target_kv: HostKV | None
    target_slot: int | None  # pdv: the verify lane's slot that now holds the prompt
    target_lease: str | None = None  # pdv: the verify replica instance that handed out target_slot
    num_cached_tokens: int = 0  # prompt tokens the prefill lane's prefix cache held
    logprobs: TokenLogprobs | None = None  # the first token's, when the request asked
    prompt_logprobs: TokenLogprobs | None = None  # echo: the prompt tokens', when asked


def replica_silent(lease: str) -> KVLost:
    """The verify replica `lease`, asked by name, did not answer within PEER_CALL_TIMEOUT_S: taken as
    gone, so its requests are recomputed on a replica that answers (at most `max_migrations` times).
    A stopping replica can be silent so while the routers have not yet learnt that it stops: on a
    busy 2-core host, a 3 -> 1 scale-down failed one stream with this timeout before it was taken as
    a loss (tests/test_verify_replicas_serve.py). A verify call that names no replica and times out means no
    verify replica answered at all: it fails as it is. (A prompt's KV that no replica takes in time is
    recomputed too: deployments/replicas/prefill_replica.py.)"""
    return KVLost.after_waiting(f"verify replica {lease} did not answer in {PEER_CALL_TIMEOUT_S:g} s",
                                PEER_CALL_TIMEOUT_S)


class RemoteVerifier:
    """The verify lane of pdv. A batch's rows may hold KV in different verify replicas: each replica
    gets its own rows (one call each, all at once), and the results come back in row order. A call
    that fails fails only its own rows."""

    def __init__(self, handle, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self.handle = handle
        self.loop = loop
        self.timeout_s = min(timeout_s, PEER_CALL_TIMEOUT_S)

    def launch(self, batch: VerifyBatch) -> concurrent.futures.Future:
        """Send the batch to the verify lane; the engine collects the result (`.result()`, bounded by
        timeout_s per replica call) after it has launched its prefill work."""
        # Only ids and probabilities cross the process boundary.
        on_host = batch.to("cpu")  # waits for the draft kernels: drafting time, not waiting time
        start_s = time.time()
        call = asyncio.run_coroutine_threadsafe(self.verify(on_host), self.loop)
        rows = len(batch.target_slots)
        call.add_done_callback(lambda _: TIMELINE.record("verify_wait", start_s, time.time(), rows=rows))
        return call

    async def verify(self, batch: VerifyBatch) -> VerifyResult:
        """The batch's rows, each verified by the replica that holds its KV (on the event loop)."""
        by_lease = rows_by_lease(batch)
        results = await asyncio.gather(*(self._verify_rows(batch.select(rows), lease)
                                         for lease, rows in by_lease.items()), return_exceptions=True)
        return merge_rows(len(batch.target_slots), list(zip(by_lease.values(), results)))

    async def _verify_rows(self, batch: VerifyBatch, lease: str | None) -> VerifyResult:
        try:
            return await asyncio.wait_for(self._call("verify", batch, lease=lease), self.timeout_s)
        except TimeoutError as exc:
            if lease is None:
                raise
            raise replica_silent(lease) from exc

    def allocate(self) -> int | None:
        return None  # the prefill lane obtains the slot when it hands the prompt's KV to the verify lane

    def release(self, target_slot: int, lease: str | None = None) -> None:
        asyncio.run_coroutine_threadsafe(self.release_now(target_slot, lease), self.loop)

    async def release_now(self, target_slot: int, lease: str | None = None) -> None:
        await self._call("release", [target_slot], lease=lease)

    async def prefill(self, order: "VerifyPrefillOrder") -> tuple[PrefillDone | BaseException, float]:
        """pdv's split: a short prompt's target KV prefilled by a verify replica, into a slot of its pool
        (deployments/channels/verify_prefill.py). The answer (or the error the engine acts on, `lane_error`) and
        the wall-clock time it came, as the prefill lane's (PrefillLaneClient)."""
        since_s = time.monotonic()
        try:
            lease, slot, kv = await self._call("prefill", order.request, owner=current_actor())
            result = PrefillDone(kv.first_token, None, None, slot, lease, logprobs=kv.logprobs,
                                 prompt_logprobs=kv.prompt_logprobs)
        except BaseException as exc:  # noqa: BLE001 - delivered to the request, the loop goes on
            result = failed_call(exc, since_s)
        return result, time.time()

    async def channel(self, lease: str):
        """Where verify replica `lease` takes batches straight from an engine (a ChannelAddress)."""
        return await asyncio.wait_for(self._call("channel", lease=lease), self.timeout_s)

    async def _call(self, method: str, *args, **kwargs):
        return await own_request(getattr(self.handle, method), *args, **kwargs)


@dataclass
class VerifyOrder:
    """A verify batch from an engine in a process of its own, for its replica to send (RemoteVerifier)."""

    batch: VerifyBatch


@dataclass
class VerifyPrefillOrder:
    """pdv's split: a short prompt whose target KV a verify replica prefills
    (deployments/channels/verify_prefill.py)."""

    request: PrefillRequest


@dataclass
class ReleaseOrder:
    """A verify slot to give back, from an engine in a process of its own."""

    target_slot: int
    lease: str | None


@dataclass
class ChannelOrder:
    """The address of verify replica `lease`'s channel (deployments/channels/verify_channel.py), from an engine
    in a process of its own."""

    lease: str


def rows_by_lease(batch: VerifyBatch) -> dict[str | None, list[int]]:
    """The batch's rows (their indices), by the verify replica that holds their KV."""
    by_lease: dict[str | None, list[int]] = {}
    for row, lease in enumerate(batch.target_leases or [None] * len(batch.target_slots)):
        by_lease.setdefault(lease, []).append(row)
    return by_lease


class LinkedVerifier:
    """pdv's verify lane from an engine in a process of its own. A batch's rows go straight to the
    verify replica that holds their KV, over its channel (deployments/channels/verify_channel.py), once this
    engine has one; until then, and with `channels` off, they cross to the engine's replica
    (lanes/engine/process.py PeerLink), which sends them on with its RemoteVerifier
    (deployments/channels/peer_calls.py)."""

    def __init__(self, link, timeout_s: float = PEER_CALL_TIMEOUT_S, channels: bool = True,
                 shared_drafts: tuple[int, int] | None = None):
        """`shared_drafts`: (max rows, max drafts) of a batch: offer each verify replica reached over a
        channel a ring of device buffers that size for its drafts (lanes/device/shared_drafts.py)."""
        self.link = link
        self.timeout_s = min(timeout_s, PEER_CALL_TIMEOUT_S)
        self.channels = VerifyChannels(self._ask_channel) if channels else None
        self.shared_drafts = shared_drafts if channels else None

    def launch(self, batch: VerifyBatch) -> "PendingParts":
        start_s, rows = time.time(), len(batch.target_slots)
        parts, relayed, on_host = [], [], None
        for lease, lease_rows in rows_by_lease(batch).items():
            channel = self.channels.get(lease) if self.channels is not None and lease is not None else None
            if channel is None:
                relayed += lease_rows
                continue
            part = self._on_device(batch, lease_rows, channel)
            if part is None:
                # Waits for the draft kernels: drafting time, not waiting time.
                on_host = on_host if on_host is not None else batch.to("cpu")
                part = on_host.select(lease_rows)
            parts.append((lease_rows, lease, channel.send(part)))
        if relayed:
            on_host = on_host if on_host is not None else batch.to("cpu")
            part = on_host if len(relayed) == rows else on_host.select(relayed)
            parts.append((relayed, None, self._relay(part)))
        return PendingParts(rows, parts, self.timeout_s,
                            lambda: self.link.record("verify_wait", start_s, time.time(), rows=rows))

    def _on_device(self, batch: VerifyBatch, rows: list[int], channel) -> VerifyBatch | None:
        """The part of `batch` for `channel`'s replica with its drafts put in that replica's ring, without
        waiting for them (None: they go through the host). Only token ids go so: a batch that carries
        probabilities (sampled drafts) or a grammar's masks, which its drafts were read on the host for,
        goes the host's way."""
        if self.shared_drafts is None or batch.draft_probs is not None or batch.token_bitmask is not None:
            return None
        part = batch if len(rows) == len(batch.target_slots) else batch.select(rows)
        ring = channel.ring(part.draft_tokens, *self.shared_drafts)
        return None if ring is None else replace(part, draft_tokens=ring.put(part.draft_tokens))

    def _relay(self, batch: VerifyBatch) -> concurrent.futures.Future:
        """Through the engine's replica (it bounds each call by the timeout, and names a lost replica)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def done(value) -> None:  # on the engine process's reader thread
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

        self.link.call(VerifyOrder(batch), done)
        return future

    def _ask_channel(self, lease: str, on_address: Callable[[object], None]) -> None:
        self.link.call(ChannelOrder(lease), on_address)

    def allocate(self) -> int | None:
        return None  # the prefill lane obtains the slot when it hands the prompt's KV to the verify lane

    def release(self, target_slot: int, lease: str | None = None) -> None:
        self.link.call(ReleaseOrder(target_slot, lease), lambda _: None)


class PendingParts:
    """A verify batch whose rows went out in parts, (rows, lease, future) each: `result()` is every
    part's answer in row order. A part sent over a channel (`lease` set) that has not answered within
    `timeout_s` of the launch is taken as its replica's loss (`replica_silent`); a relayed part
    (`lease` None) is bounded by the replica that relays it. `on_done` runs when the last part lands."""

    def __init__(self, num_rows: int, parts: list[tuple[list[int], str | None, concurrent.futures.Future]],
                 timeout_s: float, on_done: Callable[[], None]):
        self.num_rows, self.parts = num_rows, parts
        self._deadline_s = time.monotonic() + timeout_s
        self._left = len(parts)
        self._lock = threading.Lock()
        self._on_done = on_done
        for _, _, future in parts:
            future.add_done_callback(self._landed)

    def _landed(self, _future) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._on_done()

    def result(self) -> VerifyResult:
        answers = [(rows, self._wait(lease, future)) for rows, lease, future in self.parts]
        if len(answers) == 1 and not isinstance(answers[0][1], BaseException):
            return answers[0][1]  # one part of every row, in order
        return merge_rows(self.num_rows, answers)

    def _wait(self, lease: str | None, future: concurrent.futures.Future) -> VerifyResult | BaseException:
        try:
            if lease is None:
                return future.result()
            return future.result(timeout=max(0.0, self._deadline_s - time.monotonic()))
        except TimeoutError:
            return replica_silent(lease)
        except BaseException as exc:  # noqa: BLE001 - the part's rows carry it (merge_rows)
            return exc


def lane_error(exc: BaseException, via_prefill: bool = False) -> BaseException:
    """A failed call to the verify lane (`via_prefill`: a prefill call, whose replica called it) as the
    engine reads it: KVLost where the verify replica that held or took the request's KV is gone (the
    request is recomputed elsewhere), PoolFullError where it was out of blocks (requeued), LaneOOM where
    a lane ran out of device memory even in its smallest retry (recomputed, bounded), else as is.

    Gone means: the lease router no longer lists the replica (Serve stopped it on a scale-down, or saw
    it die: LeaseGone), or it died during the call (RayActorError). Either way its pool went with it.
    What a replica raises comes back wrapped (RayTaskError): from behind the prefill lane, a verify
    replica's loss is its cause; a prefill replica that died itself is no verify loss."""
    callee = exc.cause if via_prefill and isinstance(exc, RayTaskError) else None if via_prefill else exc
    if isinstance(callee, KVLost):  # LeaseGone
        return callee
    if isinstance(callee, RayActorError) and not isinstance(callee, RayTaskError):
        return KVLost(f"{type(callee).__name__}: {callee}")
    if PoolFullError.__name__ in str(exc):  # raised in the verify replica, and wrapped
        return PoolFullError(str(exc))
    if any(isinstance(e, (LaneOOM, torch.OutOfMemoryError)) for e in (exc, getattr(exc, "cause", None))):
        return LaneOOM("a lane ran out of device memory in the forward that carried this request")
    return exc


def failed_call(exc: BaseException, since_s: float, via_prefill: bool = False) -> BaseException:
    """`lane_error` of a prefill call begun at `since_s` (time.monotonic). A KVLost dates from then: the call
    waited for a replica to take the request's KV from its submission on, its queue included
    (EngineCore._migrate)."""
    result = lane_error(exc, via_prefill)
    if isinstance(result, KVLost):
        result.waited_s = time.monotonic() - since_s
    return result


def merge_rows(num_rows: int, parts: list[tuple[list[int], VerifyResult | BaseException]]) -> VerifyResult:
    """One result in row order from the results of sub-batches (`rows`: each one's rows in the batch);
    the rows of a sub-batch that failed carry its error (`lane_error`)."""
    tokens: list[list[int]] = [[] for _ in range(num_rows)]
    accepted = [0] * num_rows
    logprobs: list = [None] * num_rows
    errors: list[Exception | None] = [None] * num_rows
    for rows, result in parts:
        failed = lane_error(result) if isinstance(result, BaseException) else None
        # A sub-batch that ran may still carry errors of its own rows (a verify replica out of
        # blocks sheds some rows and verifies the rest).
        row_errors = result.errors if failed is None else None
        for i, row in enumerate(rows):
            error = failed or (row_errors[i] if row_errors is not None else None)
            if error is not None:
                errors[row] = error
                continue
            tokens[row], accepted[row] = result.tokens[i], result.num_accepted[i]
            logprobs[row] = result.logprobs[i] if result.logprobs is not None else None
    any_logprobs = any(not isinstance(r, BaseException) and r.logprobs is not None for _, r in parts)
    return VerifyResult(tokens, accepted, logprobs if any_logprobs else None,
                        errors if any(e is not None for e in errors) else None)


def current_actor():
    """This replica's actor handle (None outside an actor: in-process tests)."""
    import ray

    try:
        return ray.get_runtime_context().current_actor if ray.is_initialized() else None
    except RuntimeError:  # a driver or a task, not an actor
        return None


class RemotePrefiller:
    """Sends each admitted request to the prefill lane once and collects finished prefills.

    `link` reaches the lane: `link.call(order, on_done)` sends a PrefillOrder and later calls
    `on_done((result, reply_s))` on another thread: the replica's event loop (deployments/channels/peer_calls.py
    `ServeLink`, an engine on the replica's thread) or the engine process's reader thread
    (lanes/engine/process.py `PeerLink`). `link.record` keeps a timeline event where the replica reports it."""

    reuses_cached_blocks = False  # it prefills and hands over whole prompts
    prefills_here = False
    draft_may_lag = False  # both caches arrive whole

    def __init__(self, link, draft_pool: KVPool | None, target_pool: KVPool | None, placement: Placement,
                 owner: str):
        self.link = link
        self.draft_pool = draft_pool  # None when drafting by prompt lookup: no draft KV to receive
        self.target_pool = target_pool  # pd: local target pool; pdv: None (the verify lane owns it)
        self.placement = placement
        self.owner = owner
        self._submitted: set[str] = set()
        self._compiling: set[str] = set()  # structured output: waiting for the grammar, to send its first mask
        # (sequence, result, submitted at, reply at): wall-clock times for the prefill_wait timeline
        self._done: list[tuple[Sequence, PrefillDone | BaseException, float, float]] = []
        self._lock = threading.Lock()
        self.on_reply: Callable[[], None] | None = None  # set by the loop that steps the engine, to wake it
        self._exported: dict[str, PoolHandle] = {}

    @property
    def num_in_flight(self) -> int:
        """Prompts sent to the prefill lane whose reply has not landed yet, aborted requests' included."""
        return len(self._submitted)

    @property
    def has_replies(self) -> bool:
        # A reply for a request aborted while the prefill lane had it holds a verify slot until `step`
        # lands it: the engine must step for it even with nothing else to do (the idle loop polls this).
        return bool(self._done)

    def take_in(self, scheduler: Scheduler, budget_tokens: int, decoding: bool
                ) -> list[tuple[Sequence, int | BaseException, TokenLogprobs | None]]:
        # Landing a reply costs no device time: the prompt decodes in the step that lands it.
        self._send_new(scheduler)
        return self._land_replies(scheduler)

    def _send_new(self, scheduler: Scheduler) -> list[Sequence]:
        """Send an order for each prompt not sent yet (and ready to go); returns those sent now."""
        sent = []
        for seq in scheduler.prefilling:
            if seq.request_id not in self._submitted and self._compiled(seq):
                self._submitted.add(seq.request_id)
                self.link.call(self._order(seq), partial(self._reply, seq, time.time()))
                sent.append(seq)
        return sent

    def _land_replies(self, scheduler: Scheduler) -> list[tuple[Sequence, int | BaseException, TokenLogprobs | None]]:
        with self._lock:
            done, self._done = self._done, []
        landed, later = [], []
        for seq, result, submitted_s, reply_s in done:
            if not self._ready(seq):
                later.append((seq, result, submitted_s, reply_s))
                continue
            if (out := self._land(scheduler, seq, result)) is not None:
                landed.append(out)
                if not isinstance(result, BaseException):
                    # Submitted -> decoding: the prefill lane's queue, forward and hand-over, then
                    # the wait for this engine to take the reply in (reply_s -> end).
                    self.link.record("prefill_wait", submitted_s, time.time(), reply_s=reply_s,
                                     arrival_s=seq.arrival_s, tokens=seq.num_prompt_tokens)
        if later:
            with self._lock:
                self._done[:0] = later
        return landed

    def _ready(self, seq: Sequence) -> bool:
        """Whether a reply for `seq` may land now (a subclass that writes part of the KV itself waits
        for its write: deployments/channels/verify_prefill.py)."""
        return True

    def step(self, scheduler: Scheduler, budget_tokens: int, decoding: bool) -> list:
        return []  # no prefill work in this engine's process

    def _compiled(self, seq: Sequence) -> bool:
        """Whether the request's first-token mask can go with its prompt (structured output waits for its
        grammar to compile; the compile wakes the engine when it ends)."""
        if (waiting := pending_compile(seq)) is None:
            self._compiling.discard(seq.request_id)
            return True
        if seq.request_id not in self._compiling:
            self._compiling.add(seq.request_id)
            waiting.add_done_callback(lambda _: self.on_reply() if self.on_reply is not None else None)
        return False

    def _reply(self, seq: Sequence, submitted_s: float,
               answer: tuple[PrefillDone | BaseException, float] | BaseException) -> None:
        # An exception instead of the answer: the link itself failed (the engine process's replica is gone).
        result, reply_s = (answer, time.time()) if isinstance(answer, BaseException) else answer
        with self._lock:
            self._done.append((seq, result, submitted_s, reply_s))
        if self.on_reply is not None:
            self.on_reply()

    def holds_blocks(self, seq: Sequence) -> bool:
        # The prefill lane may be writing this prompt's KV into our blocks in place: they are freed when
        # its reply lands (`_land`), never before, so no other request can be given them meanwhile.
        return seq.request_id in self._submitted

    def forget(self, seq: Sequence) -> None:
        self._compiling.discard(seq.request_id)  # a reply still to come is dropped by `_land`

    def _order(self, seq: Sequence) -> PrefillOrder:
        # The target pool goes by handle only where the prefill lane could write it in place: a sharded
        # pool takes its KV through Ray and scatters it to its ranks (lanes/parallel/kv_handover.py).
        target_by_handle = self.target_pool is not None and self.target_pool.in_place_writable
        draft = self._export("draft", self.draft_pool)
        target = self._export("target", self.target_pool) if target_by_handle else None
        return PrefillOrder(
            # After a preemption: every token but the last (lanes/engine/sequence.py), whose KV is recomputed.
            request=PrefillRequest(seq.request_id, seq.token_ids[: seq.num_prefill_tokens], seq.params, seq.seed,
                                   first_token_bitmask(seq)),
            placement=self.placement,
            draft_slot=seq.draft_slot,
            target_slot=seq.target_slot,
            draft_pool=draft,
            target_pool=target,
            draft_blocks=self.draft_pool.slot_blocks(seq.draft_slot) if draft is not None else None,
            target_blocks=self.target_pool.slot_blocks(seq.target_slot) if target is not None else None,
            holds_target=self.target_pool is not None,
        )

    def _export(self, name: str, pool: KVPool | None) -> PoolHandle | None:
        """The pool's CUDA IPC handle (None off the GPU), exported once; the prefill lane opens it once
        and caches the view by owner."""
        if pool is None or not pool.kv.is_cuda:
            return None
        if name not in self._exported:
            self._exported[name] = PoolHandle.export(f"{self.owner}/{name}", pool)
        return self._exported[name]

    def _land(self, scheduler: Scheduler, seq: Sequence, result
              ) -> tuple[Sequence, int | BaseException, TokenLogprobs | None] | None:
        self._submitted.discard(seq.request_id)
        if seq.status is not SeqStatus.PREFILLING:
            # Aborted while its prompt was being prefilled: give back its slots (held until now, see
            # holds_blocks) and the verify slot it was given.
            scheduler.release_slots(seq)
            if isinstance(result, PrefillDone) and result.target_slot is not None and self.target_pool is None:
                scheduler.verifier.release(result.target_slot, result.target_lease)
            return None
        if isinstance(result, BaseException):
            return seq, result, None
        prompt_len = seq.num_prefill_tokens
        if not seq.resumed:
            seq.num_cached_tokens = result.num_cached_tokens
        if self.draft_pool is not None:
            if result.draft_kv is not None:
                self.draft_pool.write_slot(seq.draft_slot, result.draft_kv.tensor(self.draft_pool.kv.device))
            self.draft_pool.lengths[seq.draft_slot] = prompt_len
        if self.target_pool is not None:
            if result.target_kv is not None:
                self.target_pool.write_slot(seq.target_slot, result.target_kv.tensor(self.target_pool.kv.device))
            self.target_pool.lengths[seq.target_slot] = prompt_len
        else:
            seq.target_slot, seq.target_lease = result.target_slot, result.target_lease
        scheduler.mark_prefilled(PrefillChunk(seq, 0, prompt_len))
        seq.prompt_logprobs = result.prompt_logprobs
        return seq, result.first_token, result.logprobs
