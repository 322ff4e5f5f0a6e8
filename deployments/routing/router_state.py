"""What a deployment handle's router in this process is doing, for the log line of a peer call that
did not answer in time.

A call between lanes that times out was either never sent (still waiting in this process's router
for a replica: Serve's routing tasks, their backoff, a stale queue-length cache) or sent and not
answered (the replica's side). The router's counters tell the two apart. They are Serve internals,
read defensively: a Serve version without them gives "router state unknown", never an error.
"""

from __future__ import annotations

import time


def describe(handle) -> str:
    """One line: requests waiting to be routed, routing tasks (and how many back off), and each
    replica's cached queue length and its age, as this process's router for `handle` sees them."""
    try:
        router = _request_router(handle)
        if router is None:
            return "router not started"
        cache = getattr(router, "_replica_queue_len_cache", None)
        entries = getattr(cache, "_cache", {}) or {}
        now_s = time.time()
        cached = ", ".join(f"{replica_id.unique_id[-6:]}: {entry.queue_len} ({now_s - entry.timestamp:.1f} s old)"
                           for replica_id, entry in entries.items()) or "none"
        return (f"pending {router.num_pending_requests}, routing tasks {router.curr_num_routing_tasks} of "
                f"{router.max_num_routing_tasks} ({router.num_routing_tasks_in_backoff} backing off), "
                f"replicas {len(router.curr_replicas)}, cached queue lengths: {cached}")
    except Exception as exc:  # noqa: BLE001 - Serve internals moved: say so, never fail the caller
        return f"router state unknown ({type(exc).__name__})"


def _request_router(handle):
    router = getattr(handle, "_router", None)
    asyncio_router = getattr(router, "_asyncio_router", router)
    return getattr(asyncio_router, "request_router", None)
