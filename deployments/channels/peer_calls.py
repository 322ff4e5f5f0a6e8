"""The decode replica's calls to the other lanes for its engine, on the replica's event loop (the only
place Ray is).

The engine builds a `PrefillOrder` for each prompt: what it knows (its slots, its pools' blocks and
CUDA IPC handles, where it runs). `PrefillLaneClient` turns an order into the `PrefillJob` the prefill
lane takes, once it knows where that lane runs (its KV goes into our pools in place where it can write
there), sends it, and reads a failure the way the engine recomputes or fails it.

Two ways reach the lanes from the engine:
  - the engine steps in a process of its own (the default, lanes/engine/process.py): its orders
    (`PrefillOrder`, and in pdv `VerifyPrefillOrder`, `ReleaseOrder`, `ChannelOrder` and the
    `VerifyOrder`s of replicas it has no channel to yet, deployments/channels/verify_channel.py) cross the
    socket to the replica, and
    `EnginePeers.answer` sends each on and returns the answer;
  - the engine steps on a thread of this replica (`engine_process: false`): `ServeLink` schedules a
    prompt's call on the event loop, and pdv's `RemoteVerifier` its verify calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from deployments.channels.remote import (PEER_CALL_TIMEOUT_S, ChannelOrder, PrefillDone, PrefillJob, PrefillOrder,
                                         ReleaseOrder, RemoteVerifier, VerifyOrder, VerifyPrefillOrder, current_actor,
                                         failed_call)
from deployments.placement.kv_transfer import Placement
from deployments.routing.serve_calls import own_request
from deployments.telemetry.timeline import TIMELINE
from lanes.engine.process import picklable

log = logging.getLogger(__name__)


class PrefillLaneClient:
    """Sends orders to the prefill lane through its Serve handle."""

    def __init__(self, handle):
        self.handle = handle
        self._peer: Placement | None = None  # where the prefill lane runs, asked once

    async def prefill(self, order: PrefillOrder) -> tuple[PrefillDone | BaseException, float]:
        """The lane's answer (or the error the engine acts on) and the wall-clock time it came."""
        since_s = time.monotonic()
        try:
            if self._peer is None:
                self._peer = await own_request(self.handle.placement)
            result = await own_request(self.handle.prefill, self.job(order, self._peer))
        except BaseException as exc:  # noqa: BLE001 - delivered to the request, the loop goes on
            result = failed_call(exc, since_s, via_prefill=True)
        return result, time.time()

    @staticmethod
    def job(order: PrefillOrder, peer: Placement) -> PrefillJob:
        in_place = peer.can_write_into(order.placement)
        draft_in_place = in_place and order.draft_pool is not None
        target_in_place = in_place and order.target_pool is not None
        # This replica's actor: the prefill lane drops its views of our pools once it dies (and, in
        # pdv, the verify lane frees the slots it handed us). The engine process is no actor.
        actor = current_actor()
        return PrefillJob(
            request=order.request,
            draft_slot=order.draft_slot,
            draft_pool=dataclasses.replace(order.draft_pool, actor=actor) if draft_in_place else None,
            target_slot=order.target_slot,
            target_pool=dataclasses.replace(order.target_pool, actor=actor) if target_in_place else None,
            draft_blocks=order.draft_blocks if draft_in_place else None,
            target_blocks=order.target_blocks if target_in_place else None,
            want_target_kv=order.holds_target and not target_in_place,
            sent_s=time.time(),
            owner=actor,
        )


async def prefilled_by(order: PrefillOrder | VerifyPrefillOrder, prefill: PrefillLaneClient | None,
                       verify: RemoteVerifier | None) -> tuple[PrefillDone | BaseException, float]:
    """A prompt's order answered by the lane that prefills it: the prefill lane, or in pdv's split a verify
    replica (deployments/channels/verify_prefill.py); (the answer or the error the engine acts on, when it came)."""
    lane = verify if isinstance(order, VerifyPrefillOrder) else prefill
    return await lane.prefill(order)


class ServeLink:
    """How an engine stepping on a thread of this replica reaches the prefill lane (and in pdv's split
    the verify lane, `verify`, for its short prompts): each order is sent from the replica's event loop,
    and `on_done((result, reply_s))` runs there when it is answered."""

    def __init__(self, client: PrefillLaneClient, loop: asyncio.AbstractEventLoop,
                 verify: RemoteVerifier | None = None):
        self.client = client
        self.loop = loop
        self.verify = verify

    def call(self, order: PrefillOrder | VerifyPrefillOrder, on_done: Callable[[tuple], None]) -> None:
        asyncio.run_coroutine_threadsafe(self._call(order, on_done), self.loop)

    async def _call(self, order: PrefillOrder | VerifyPrefillOrder, on_done: Callable[[tuple], None]) -> None:
        on_done(await prefilled_by(order, self.client, self.verify))

    @staticmethod
    def record(kind: str, start_s: float, end_s: float, **info) -> None:
        TIMELINE.record(kind, start_s, end_s, **info)


class EnginePeers:
    """Answers the orders of an engine in a process of its own (ProcessEngine's `serve_peer`). Each
    answer crosses a socket to the engine, so an error goes as one that unpickles there."""

    def __init__(self, prefill=None, verify=None, timeout_s: float = PEER_CALL_TIMEOUT_S):
        self.prefill = PrefillLaneClient(prefill) if prefill is not None else None
        self.verify = RemoteVerifier(verify, None, timeout_s) if verify is not None else None

    async def answer(self, order):
        if isinstance(order, (PrefillOrder, VerifyPrefillOrder)):
            result, reply_s = await prefilled_by(order, self.prefill, self.verify)
            return (picklable(result) if isinstance(result, BaseException) else result), reply_s
        if isinstance(order, VerifyOrder):
            result = await self.verify.verify(order.batch)
            if result.errors is not None:
                result.errors = [None if e is None else picklable(e) for e in result.errors]
            return result
        if isinstance(order, ReleaseOrder):
            try:
                await self.verify.release_now(order.target_slot, order.lease)
            except Exception as exc:  # noqa: BLE001 - a replica gone with the slot: nothing to free
                log.info("releasing verify slot %d of %s: %s", order.target_slot, order.lease, exc)
            return None
        if isinstance(order, ChannelOrder):
            try:
                return await self.verify.channel(order.lease)
            except Exception as exc:  # noqa: BLE001 - the engine's calls to that replica go on through Ray
                return picklable(exc)
        raise TypeError(f"an engine sent an order of unknown kind {type(order).__name__}")
