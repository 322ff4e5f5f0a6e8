"""When this replica's lane was busy, and with what: intervals on the host's wall clock.

Benchmarks line the lanes up against each other from these (benchmarks/dual_gpu.py): whether the
verify lane scores one group of requests while the decode lane drafts for another, and what each
KV hand-over from the prefill lane costs. `time.time()` is one clock for every process of a node,
so intervals of different replicas compare directly (across nodes only as well as NTP keeps them).

Kinds recorded (one interval per event, extra fields as noted):
    step         decode lane / co-located engine: one engine step                      rows
    prefill_wait decode lane (pd, pdv): one request from its submission to the prefill     reply_s,
                 lane until it joins the decode batch (reply_s: the prefill lane's reply   arrival_s,
                 came; arrival_s: the request reached this replica)                      tokens
    verify_wait  decode lane (pdv): one batch's verify call, from sending to its reply rows
    verify       verify lane: one target forward over merged batches                   rows, calls
    load_kv      verify lane: taking in a prompt's KV copied from elsewhere            tokens, bytes
    prefill      prefill lane: one batched prefill forward                             rows, tokens
    handover     prefill lane: one request from its batch's forward end until the reply   tokens, target,
                 is ready: KV writes into its owners, then the RPCs (target / draft:      draft, *_bytes,
                 "in_place", "peer" or "copied"; *_bytes: KV size moved; sent_s: the      sent_s,
                 decode replica sent it; received_s: this replica received it; batch_s:  received_s,
                 its batch began; written_s: the batch's KV writes ended)                 batch_s, written_s
    request      ingress: one request (choice), from its HTTP handler's start to its    called_s, first_s,
                 end (called_s: it called the decode lane; first_s: its first token      request_id
                 reached the ingress); decode lane / co-located engine: from generate()
                 to its last chunk (first_s: its first token left the engine)

One timeline per process, hence one per replica; bounded in count and in age, so a long-running
server only keeps the most recent events.
"""

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import TypeVar

import ray

from deployments.placement.kv_transfer import Placement

MAX_EVENTS_PER_KIND = 50_000  # a verify step every ~20 ms fills this in ~17 minutes
# ... and none that ended longer than this before the newest of its kind. The count alone let the
# kinds recorded once per request (request, prefill_wait, handover: 250-700 B each) grow for 70
# minutes at 12 requests/s, and the per-step kinds for 30: a 20-minute pdv soak (issue 33) read as
# every lane's RSS growing linearly (the decode lane's by ~2 KB per request, most of it these).
# Readers take a load point's window right after it ends (benchmarks/lib/apps.py lane_reader).
MAX_EVENT_AGE_S = 300.0
REPORT_PAGE_EVENTS = 400  # events per kind in one timeline() reply: ~40 KB at most

T = TypeVar("T")


class Timeline:
    def __init__(self, max_events: int = MAX_EVENTS_PER_KIND, max_age_s: float = MAX_EVENT_AGE_S):
        self.max_events = max_events
        self.max_age_s = max_age_s
        self._events: dict[str, deque[dict]] = {}
        self._lock = threading.Lock()  # worker threads record while the event loop reads

    def record(self, kind: str, start_s: float, end_s: float, **info) -> None:
        with self._lock:
            events = self._events.setdefault(kind, deque(maxlen=self.max_events))
            events.append({"start_s": start_s, "end_s": end_s, **info})
            # Relative to this event's end, not the clock (tests record synthetic times); the new
            # event itself is within the horizon, so the loop ends.
            horizon = end_s - self.max_age_s
            while events[0]["end_s"] < horizon:
                events.popleft()

    def timed(self, kind: str, fn: Callable[..., T], **info) -> Callable[..., T]:
        """`fn`, recording the interval it runs in (wrap what a lane worker thread executes)."""
        def run(*args):
            start_s = time.time()
            try:
                return fn(*args)
            finally:
                self.record(kind, start_s, time.time(), **info)
        return run

    def since(self, start_s: float, offset: int = 0, limit: int | None = None) -> dict[str, list[dict]]:
        """Events that ended at or after `start_s`, by kind: the `offset`-th to the `offset + limit`-th
        of each kind (pages of a long timeline; new events only append)."""
        end = None if limit is None else offset + limit
        with self._lock:
            return {kind: [e for e in events if e["end_s"] >= start_s][offset:end]
                    for kind, events in self._events.items()}


TIMELINE = Timeline()


def replica_report(lane: str, placement: Placement, start_s: float, offset: int = 0,
                   limit: int = REPORT_PAGE_EVENTS) -> dict:
    """What a lane deployment's `timeline()` returns: who it is, where it runs, and one page of what
    it did since `start_s`, as columns per kind ({"verify": {"start_s": [...], "rows": [...]}}).
    `more` says whether a later page (offset + limit) has events. Pages keep each reply small:
    Ray 2.60 crashes the caller of `handle.broadcast()` when a reply is large enough to go through
    the object store (over 100 KB)."""
    try:
        from ray import serve
        replica = serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (tests): the process id names it
        replica = f"pid-{os.getpid()}"
    gpu_ids = [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
    page = TIMELINE.since(start_s, offset, limit)
    return {"lane": lane, "replica": replica, "placement": asdict(placement), "ray_gpu_ids": gpu_ids,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "events": {kind: _columns(events) for kind, events in page.items()},
            "more": any(len(events) == limit for events in page.values())}


def _columns(events: list[dict]) -> dict[str, list]:
    return {key: [e[key] for e in events] for key in (events[0] if events else {})}


def event_rows(columns: dict[str, list]) -> list[dict]:
    """Events of one kind back as one dict each (the inverse of the report's columns)."""
    keys = list(columns)
    return [dict(zip(keys, values)) for values in zip(*(columns[k] for k in keys))]
