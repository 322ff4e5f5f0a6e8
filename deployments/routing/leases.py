"""A verify replica's lease, and what a call for one that is gone raises.

Apart from the router that routes by lease (deployments/routing/lease_router.py), because Serve pickles a request
router's module by value: a router in another process (a decode replica's, the driver's) runs a copy of that module,
and a class defined there would be a copy too. Defined here, LeaseGone pickles by reference, so `except LeaseGone`
catches what any router raises, in an app declared by `serve deploy` as in one run by `serve.run`."""

import uuid

from ray import serve
from ray.serve.exceptions import RayServeException

from lanes.engine.backends import KVLost


class LeaseGone(KVLost):
    """The verify replica that owns this lease (and the KV of the requests it holds) is gone."""


def replica_lease() -> str:
    """This verify replica's lease: its Serve replica id (a fresh id outside Serve, in tests)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:  # not in a Serve replica
        return uuid.uuid4().hex
