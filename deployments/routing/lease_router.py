"""Verify-lane affinity: a call that names a lease reaches the verify replica that owns it. (The decode
lane uses it too under `stream_channel: step`: an ingress's subscription names the decode replica whose
channel it reads, deployments/channels/step_inbox.py.)

A request's target KV lives in one verify replica (the one that handed out its slot). Its lease is
that replica's Serve replica id, so a caller's router can find the owner among the replicas it
routes to. The contract, for every handle to the VerifyLane deployment:

- a call with the keyword argument `lease=<id>` goes to replica `<id>` and nowhere else;
- a call without one (`allocate_many`, `load_kv`, `stats`, ...) goes to the less loaded of two
  random replicas, as Serve's default router does;
- a call whose lease names a replica that is gone (Serve stopped it on a scale-down, which drops it
  from every router at once, or it died) fails at once with `LeaseGone`: its KV went with the
  replica, and the decode replica recomputes the request on another one (EngineCore._migrate). One
  naming a replica this router has never seen (started a moment ago) fails after
  `UNKNOWN_LEASE_WAIT_S`.

Why a router rather than pinning each decode replica to one verify replica: a decode replica's
requests spread over every verify replica, so each verify replica merges rows of every decode
replica into large batches, and the loss of one verify replica touches only the requests whose KV it
held.
"""

import random
import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deployments.routing.leases import LeaseGone

LEASE_KWARG = "lease"
# Serve tells each caller's router of a new replica within a moment of its start; a lease unknown
# for longer belongs to a replica that died before this router saw it.
UNKNOWN_LEASE_WAIT_S = 5.0


class LeaseRouter(RequestRouter):
    """Routes a leased call to its owner; any other call to the less loaded of two random replicas.

    Built on `RequestRouter` alone: `FIFOMixin` would hand a replica that was chosen for one
    request to the oldest waiting request, which may be leased to another replica."""

    def initialize_state(self, **kwargs) -> None:
        self._seen: set[str] = set()  # every replica id this router has routed to, now or before

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        self._seen.update(r.replica_id.unique_id for r in replicas)
        super().update_replicas(replicas)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Without this, Serve retries at once, in a tight loop, while the chosen replica is full.
            pending_request.routing_context.should_backoff = True
        lease = pending_request.kwargs.get(LEASE_KWARG) if pending_request is not None else None
        if lease is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        owner = [r for r in candidate_replicas if r.replica_id.unique_id == lease]
        if owner:
            return [owner]
        if lease in self._seen:
            return self._fail(pending_request, candidate_replicas, f"verify replica {lease} is gone")
        if time.time() - pending_request.created_at > UNKNOWN_LEASE_WAIT_S:
            return self._fail(pending_request, candidate_replicas,
                              f"verify replica {lease} was not seen in {UNKNOWN_LEASE_WAIT_S:g} s")
        return []  # a replica that started a moment ago: Serve calls again after a backoff

    @staticmethod
    def _fail(pending_request: PendingRequest, candidates: list[RunningReplica], why: str
              ) -> list[list[RunningReplica]]:
        # The caller awaits this future: the error reaches it now. Serve's routing loop stops
        # routing a request whose future is done before it looks at the replicas returned; it must
        # be given some, since a loop that gets none calls again and never sees the future.
        if not pending_request.future.done():
            pending_request.future.set_exception(LeaseGone(why))
        return [candidates]
