"""A call from one replica to another deployment, under a Serve request id of its own.

Why: a handle call made while a replica serves a request inherits that request's internal id
(ray/serve/_private/default_impl.py, `get_request_metadata`), and Serve's router indexes the calls
waiting for a replica by that id (`RequestRouter._pending_requests_by_id`, Ray 2.60). Two calls of
one request context waiting at once share an id: the router indexes only the first, routes the
other's replica to the first, and the other's routing task backs off forever. It surfaced on an H200
as a prefill lane's `allocate_many` unanswered for 5 s, then 60 s, while its verify replica was idle
(benchmarks/results/lanes_1gpu_h200/before_fix/): the prefill lane's batch loop makes every call of every
batch in the context of the request that started it. tests/test_serve_calls.py shows the strand
with plain Serve, and that a call made here is not stranded.
"""

from __future__ import annotations

import contextvars
import dataclasses
import uuid

from ray.serve import context as serve_context


def own_request(method, *args, **kwargs):
    """`method.remote(*args, **kwargs)` (a handle method) sent with a fresh internal request id; the
    request id that logs show is kept, so the call still reads as part of the request that made it."""
    return contextvars.copy_context().run(_send, method, args, kwargs)


def _send(method, args, kwargs):
    current = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))
    return method.remote(*args, **kwargs)
