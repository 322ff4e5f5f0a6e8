"""Which decode replica each of the verify lane's KV slots serves, and giving back the slots of one
that died.

In pdv a request's target KV lives in the verify lane, but the request itself lives in a decode
replica, which frees the slot when the request ends. A decode replica killed mid-stream never does,
so the verify lane would keep those slots forever. It asks Ray instead: every few seconds it pings
each decode replica that holds slots, and frees the slots of one whose actor is dead.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ray.exceptions import RayActorError

log = logging.getLogger(__name__)

REAP_INTERVAL_S = 2.0
PING_TIMEOUT_S = 5.0  # an owner that does not answer in time is busy, not dead: Ray says dead at once


class SlotOwners:
    def __init__(self, free: Callable[[list[int]], Awaitable[None]]):
        self._free = free  # frees slots in the lane's pool (and drops them here)
        self._by_slot: dict[int, str] = {}  # slot -> owner's actor id
        self._handles: dict[str, object] = {}  # owner's actor id -> its actor handle
        self._task: asyncio.Task | None = None
        self.num_reclaimed = 0  # slots freed because their owner died

    def hold(self, slot: int, owner) -> None:
        """`slot` now serves a request of `owner` (an actor handle; None: no owner to watch)."""
        if owner is None:
            return
        key = owner._actor_id.hex()
        self._by_slot[slot] = key
        self._handles[key] = owner
        if self._task is None:  # started lazily, on the replica's event loop
            self._task = asyncio.get_running_loop().create_task(self._reap_forever())

    def drop(self, slot: int) -> None:
        self._by_slot.pop(slot, None)

    async def reap(self) -> int:
        """Free the slots of every owner that Ray reports dead; returns how many were freed."""
        keys = set(self._by_slot.values())
        for key in list(self._handles):
            if key not in keys:
                del self._handles[key]  # holds no slot any more
        alive = await asyncio.gather(*(actor_alive(self._handles[k]) for k in keys))
        dead = {k for k, ok in zip(keys, alive) if not ok}
        slots = [slot for slot, key in self._by_slot.items() if key in dead]
        if slots:
            log.warning("freeing %d KV slots of %d decode replicas that died", len(slots), len(dead))
            await self._free(slots)
            self.num_reclaimed += len(slots)
        return len(slots)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            try:
                await self.reap()
            except Exception:  # noqa: BLE001 - the watch must outlive one failed round
                log.exception("reaping the slots of dead decode replicas failed")


async def actor_alive(handle) -> bool:
    """Whether Ray reports this actor alive (one that is only slow to answer counts as alive)."""
    try:
        await asyncio.wait_for(handle.__ray_ready__.remote(), PING_TIMEOUT_S)
    except RayActorError:
        return False
    except asyncio.TimeoutError:
        return True
    return True
