"""deployments/routing/serve_calls.py: calls that one request context makes at once to a deployment routed by
LeaseRouter all reach it (a real Serve instance; plain handles strand them).

Serve gives every call made while a replica serves a request that request's internal id, and indexes
waiting calls by it; LeaseRouter, which must not hand one request's replica to another
(deployments/routing/lease_router.py), fulfils a waiting call only through that index. So of several calls of
one context that wait at once, all but one are stranded. The verify lane's `max_ongoing_requests`
of 1 here makes them wait, as a busy router did on an H200.
"""

import asyncio

import pytest
from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.routing.lease_router import LeaseRouter
from tests.serve_helpers import ray_cluster

pytestmark = pytest.mark.serve

APP = "serve-calls"
CALLS = 4


@serve.deployment(max_ongoing_requests=1, ray_actor_options={"num_cpus": 0.05},
                  request_router_config=RequestRouterConfig(request_router_class=LeaseRouter))
class Callee:
    async def work(self, i: int) -> int:
        await asyncio.sleep(0.05)
        return i


@serve.deployment(ray_actor_options={"num_cpus": 0.05})
class Caller:
    def __init__(self, callee):
        self.callee = callee

    async def fan_out(self, own: bool, wait_s: float) -> list[int]:
        """CALLS calls at once from this request's context; the answers that came within `wait_s`."""
        from deployments.routing.serve_calls import own_request
        calls = [asyncio.ensure_future(own_request(self.callee.work, i) if own else self.callee.work.remote(i))
                 for i in range(CALLS)]
        done, pending = await asyncio.wait(calls, timeout=wait_s)
        for call in pending:
            call.cancel()
        return sorted(call.result() for call in done)


@pytest.fixture(scope="module")
def caller():
    ray_cluster()
    handle = serve.run(Caller.bind(Callee.bind()), name=APP, route_prefix=None)
    yield handle
    serve.delete(APP)


def test_calls_of_one_request_context_sent_with_their_own_ids_all_arrive(caller):
    assert caller.fan_out.remote(True, 20.0).result(timeout_s=60) == list(range(CALLS))


def test_plain_handle_calls_of_one_request_context_are_stranded_by_lease_router(caller):
    # Why own_request exists: if this starts passing all calls, Serve indexes waiting calls by a
    # unique id again, and serve_calls.py can go.
    answered = caller.fan_out.remote(False, 5.0).result(timeout_s=60)
    assert len(answered) < CALLS, answered
