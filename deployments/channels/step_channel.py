"""One stream message per engine step per ingress replica, instead of one per request (`stream_channel: step`).

Why: a Serve stream message costs its sender and its receiver a fixed amount of CPU whatever it carries
(about 0.2 ms in a decode replica and 0.4 ms in the ingress on an H100 host,
benchmarks/results/stream_hops_h100/). Streaming every step to n requests costs n messages a step, so at 64
in flight the decode replica's and the ingress's event loops, not the GPU, bound the tok/s. vLLM's engine
core and SGLang's scheduler send each step's outputs of all requests in one message for the same reason.

The engine side (`StepChannels`, in the decode replica): each ingress replica names a channel. A request of
that channel still runs as its own Serve call, which carries its first output (with a `StepTicket` naming
this replica), a `StepEnd` once its last output is in the channel, its refusal or failure, and its
cancellation. Its other outputs wait in the channel, merged per request, until that ingress's one
subscription (`stream`) takes them, all at once, as one message.

With `max_stream_messages_per_s` (or `stream_interval_ms`) each request's chunks wait for a timer of their
own in the engine front, so one step's chunks can reach the channel at several moments and go as several
messages; streaming every step (no bound) is what keeps it to one.

Serve counts each subscription as an ongoing call of the decode replica (one per ingress replica that has
requests there): its default autoscaling policy sees that many more, and the builder gives the lane room
for them beyond `max_ongoing_requests`.

The ingress side is deployments/channels/step_inbox.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from lanes.engine.outputs import RequestOutput, merge_outputs

# A subscription with no request of its channel open here ends after this long, so that a replica being
# scaled down is not held by it (Serve waits for ongoing calls) and Serve's count of ongoing requests does
# not carry it forever. The ingress opens it again with its next request here.
IDLE_END_S = 2.0
# A channel that nobody has read for this long and that has no request open is dropped with what it holds:
# its ingress replica is gone (a live one subscribes within moments of a request's first chunk).
ABANDONED_S = 60.0


@dataclass
class StepTicket:
    """A channel request's first message: its first output, and the replica whose channel carries the rest."""

    replica: str  # the decode replica's Serve replica id: a subscription's `lease` (lease_router.py)
    first: RequestOutput


@dataclass
class StepEnd:
    """A channel request's last message on its own call: whether its last output went to the channel (if
    not, the engine dropped the request unfinished, and its reader must not wait for more)."""

    delivered: bool


class _Channel:
    def __init__(self):
        self.pending: dict[str, list[RequestOutput]] = {}  # request id -> outputs not yet sent, in order
        self.open: set[str] = set()  # requests of this channel running here
        self.wake = asyncio.Event()
        self.generation = 0  # a newer subscription ends an older one: one reader, so order is kept
        self.readers = 0
        self.read_s = time.monotonic()  # when a subscription last read it (or when it was made)


class StepChannels:
    """The decode replica's channels, on its event loop."""

    def __init__(self):
        self._channels: dict[str, _Channel] = {}
        self.num_messages = 0  # subscription messages sent (each one carries a step's outputs or more)

    def register(self, channel: str, request_id: str) -> None:
        self._get(channel).open.add(request_id)

    def put(self, channel: str, out: RequestOutput) -> None:
        ch = self._get(channel)
        ch.pending.setdefault(out.request_id, []).append(out)
        ch.wake.set()

    def end(self, channel: str, request_id: str, delivered: bool) -> None:
        """The request's call ended. `delivered`: its last output is in the channel (else its caller left,
        and what waits for it is dropped)."""
        ch = self._channels.get(channel)
        if ch is None:
            return
        ch.open.discard(request_id)
        if not delivered:
            ch.pending.pop(request_id, None)
        if not ch.open and not ch.pending:
            ch.wake.set()  # an idle subscription may end
        self._sweep()

    def _sweep(self) -> None:
        now_s = time.monotonic()
        for name, ch in list(self._channels.items()):
            if not ch.readers and not ch.open and now_s - ch.read_s > ABANDONED_S:
                del self._channels[name]

    async def stream(self, channel: str, idle_end_s: float = IDLE_END_S) -> AsyncIterator[dict[str, RequestOutput]]:
        """The channel's outputs, one message per wake-up: every request's outputs since the last, merged."""
        ch = self._get(channel)
        ch.generation += 1
        mine = ch.generation
        ch.readers += 1
        try:
            while ch.generation == mine:
                ch.read_s = time.monotonic()
                if not ch.pending:
                    ch.wake.clear()
                    try:
                        await asyncio.wait_for(ch.wake.wait(), timeout=idle_end_s)
                    except TimeoutError:
                        if not ch.open and not ch.pending:
                            return
                    continue
                batch, ch.pending = ch.pending, {}
                self.num_messages += 1
                yield {rid: merge_outputs(outs) for rid, outs in batch.items()}
        finally:
            ch.readers -= 1
            ch.read_s = time.monotonic()
            if ch.generation == mine and not ch.open and not ch.pending and self._channels.get(channel) is ch:
                del self._channels[channel]

    def _get(self, channel: str) -> _Channel:
        ch = self._channels.get(channel)
        if ch is None:
            ch = self._channels[channel] = _Channel()
        return ch
