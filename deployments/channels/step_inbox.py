"""The ingress side of `stream_channel: step` (deployments/channels/step_channel.py): one subscription per
decode replica that holds a request of this ingress replica, fanning each message's outputs out to the
requests' own queues.

A request's outputs come in order: its first in its own call's StepTicket, the rest through the one
subscription to the replica the ticket names (a replica's channel has one reader at a time). Its own call
stays open until its last output is in the channel: the call's failure (a replica that died, an engine that
lost a lane) reaches the request through it, and leaving early cancels it in the lanes as before.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator

from deployments.channels.step_channel import StepEnd, StepTicket
from deployments.routing.serve_calls import own_request
from lanes.engine.outputs import RequestOutput, merge_outputs

log = logging.getLogger(__name__)
_CUT = object()  # in a request's queue: the engine ended it unfinished


class StepInbox:
    """This ingress replica's channel: `open()` a request's stream of outputs over it."""

    def __init__(self, engine, on_merged=None):
        """`on_merged(n)`: n outputs of a request went out merged into another's chunk (a metric's count)."""
        self.engine = engine  # the decode lane's handle
        self.on_merged = on_merged
        self.channel = uuid.uuid4().hex
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its outputs (or the exception that ends it)
        self._replica_of: dict[str, str] = {}  # request id -> the decode replica whose channel carries it
        self._subscriptions: dict[str, asyncio.Task] = {}  # replica id -> the task reading its channel
        self.num_merged = 0  # outputs that waited for their request's reader and went out merged

    def open(self, prompt, params, request_id: str) -> "ChannelStream":
        """The request's outputs: its call to the decode lane, then its channel's."""
        queue = self._queues[request_id] = asyncio.Queue()
        call = own_request(self.engine.options(stream=True).generate, prompt, params, request_id,
                           channel=self.channel)
        return ChannelStream(self, call, request_id, queue)

    def follow(self, request_id: str, replica: str) -> None:
        """The request's later outputs come through `replica`'s channel."""
        self._replica_of[request_id] = replica
        self._subscribe(replica)

    def _subscribe(self, replica: str) -> None:
        """Read `replica`'s channel, if not already."""
        task = self._subscriptions.get(replica)
        if task is None or task.done():
            self._subscriptions[replica] = asyncio.get_running_loop().create_task(self._read(replica))

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._replica_of.pop(request_id, None)

    def fail(self, request_id: str, exc) -> None:
        """End the request's stream with `exc` (raised to its reader), or `_CUT`."""
        if (queue := self._queues.get(request_id)) is not None:
            queue.put_nowait(exc)

    async def _read(self, replica: str) -> None:
        sub = own_request(self.engine.options(stream=True).steps, self.channel, lease=replica)
        try:
            async for batch in sub:
                for request_id, out in batch.items():
                    if (queue := self._queues.get(request_id)) is not None:
                        queue.put_nowait(out)
        except Exception as exc:  # noqa: BLE001 - the replica died: every request it carried ends with this
            log.warning("decode replica %s's channel failed: %r", replica, exc)
            for request_id in [r for r, rep in self._replica_of.items() if rep == replica]:
                self.fail(request_id, exc)
            return
        finally:
            if self._subscriptions.get(replica) is asyncio.current_task():
                del self._subscriptions[replica]
        # It ended as idle while a request had just started there (its ticket on the way): read it again.
        if replica in self._replica_of.values():
            self._subscribe(replica)


class ChannelStream:
    """A request's outputs over a channel, read as its own call's stream was: async iteration, `cancel()`."""

    def __init__(self, inbox: StepInbox, call, request_id: str, queue: asyncio.Queue):
        self.inbox, self.call, self.request_id, self.queue = inbox, call, request_id, queue
        self._outputs = self._iterate()
        self._watch: asyncio.Task | None = None

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._outputs.__anext__()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            first = await self.call.__anext__()
        except StopAsyncIteration:  # ends this stream as the call's own end would
            return
        if not isinstance(first, StepTicket):  # a refusal (GenerateError): the call says it all
            yield first
            async for item in self.call:
                yield item
            return
        if not first.first.finished:  # read the channel from now on, not when the first chunk has been sent
            self.inbox.follow(self.request_id, first.replica)
            self._watch = asyncio.get_running_loop().create_task(self._watch_call())
        yield first.first
        if first.first.finished:
            return
        queue = self.queue
        while True:
            # What waits is merged into one chunk: it waits only where this replica's event loop fell behind.
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            outs = list(itertools.takewhile(lambda i: isinstance(i, RequestOutput), items))
            if outs:
                self.inbox.num_merged += len(outs) - 1
                if self.inbox.on_merged is not None and len(outs) > 1:
                    self.inbox.on_merged(len(outs) - 1)
                yield merge_outputs(outs)
                if outs[-1].finished:
                    return
            if len(outs) < len(items):  # then the request's end: a failure, or cut short by the engine
                end = items[len(outs)]
                if isinstance(end, BaseException):
                    raise end
                return

    async def _watch_call(self) -> None:
        """The call ends with a StepEnd once the request's last output went to the channel; if it fails
        first, so does the request, and if the engine dropped it unfinished, its stream ends short."""
        try:
            async for item in self.call:
                if isinstance(item, StepEnd) and not item.delivered:
                    self.inbox.fail(self.request_id, _CUT)
        except Exception as exc:  # noqa: BLE001 - handed to the request's reader
            self.inbox.fail(self.request_id, exc)

    def cancel(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self.call.cancel()
        self.inbox.close(self.request_id)
