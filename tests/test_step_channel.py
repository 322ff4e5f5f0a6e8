"""The decode replica's side of `stream_channel: step` (deployments/channels/step_channel.py), on one event
loop: a subscription's message carries every request's outputs since the last, merged and in order; it ends
when idle, never while a request of its channel runs; a request whose caller left leaves nothing behind."""

import asyncio

from deployments.channels.step_channel import StepChannels
from lanes.engine.outputs import RequestOutput


def _out(rid: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [token], str(token), finished, "length" if finished else None,
                         num_output_tokens=token)


async def _take(stream, n: int) -> list[dict]:
    return [await asyncio.wait_for(stream.__anext__(), 1.0) for _ in range(n)]


def test_one_message_carries_every_request_merged_in_order():
    async def main():
        channels = StepChannels()
        for rid in ("a", "b"):
            channels.register("ing", rid)
        channels.put("ing", _out("a", 1))
        channels.put("ing", _out("b", 1))
        channels.put("ing", _out("a", 2))  # a second step before the reader came: merged
        stream = channels.stream("ing", idle_end_s=0.05)
        (first,) = await _take(stream, 1)
        channels.put("ing", _out("b", 2, finished=True))
        (second,) = await _take(stream, 1)
        await stream.aclose()
        return first, second, channels.num_messages

    first, second, messages = asyncio.run(main())
    assert {rid: out.token_ids for rid, out in first.items()} == {"a": [1, 2], "b": [1]}
    assert first["a"].text == "12" and first["a"].num_output_tokens == 2
    assert list(second) == ["b"] and second["b"].finished and second["b"].token_ids == [2]
    assert messages == 2


def test_a_subscription_ends_when_idle_but_not_while_a_request_runs():
    async def main():
        channels = StepChannels()
        channels.register("ing", "a")
        stream = channels.stream("ing", idle_end_s=0.05)
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.2)  # four idle periods with "a" open: still subscribed
        assert not waiting.done()
        channels.put("ing", _out("a", 1, finished=True))
        got = await asyncio.wait_for(waiting, 1.0)
        channels.end("ing", "a", delivered=True)
        try:
            await asyncio.wait_for(stream.__anext__(), 1.0)
        except StopAsyncIteration:
            return got, channels._channels
        raise AssertionError("an idle subscription went on")

    got, left = asyncio.run(main())
    assert got["a"].finished
    assert left == {}  # the idle channel is gone with its subscription


def test_a_request_whose_caller_left_leaves_nothing_in_the_channel():
    async def main():
        channels = StepChannels()
        channels.register("ing", "gone")
        channels.register("ing", "kept")
        channels.put("ing", _out("gone", 1))
        channels.put("ing", _out("kept", 1))
        channels.end("ing", "gone", delivered=False)  # its call was cancelled: the client left
        stream = channels.stream("ing", idle_end_s=0.05)
        (batch,) = await _take(stream, 1)
        await stream.aclose()
        return batch

    assert list(asyncio.run(main())) == ["kept"]


def test_a_newer_subscription_ends_the_older_so_one_reader_keeps_the_order():
    async def main():
        channels = StepChannels()
        channels.register("ing", "a")
        old = channels.stream("ing", idle_end_s=0.05)
        old_next = asyncio.ensure_future(old.__anext__())
        await asyncio.sleep(0.01)
        new = channels.stream("ing", idle_end_s=0.05)
        new_next = asyncio.ensure_future(new.__anext__())
        await asyncio.sleep(0.01)
        channels.put("ing", _out("a", 1))
        got = await asyncio.wait_for(new_next, 1.0)
        ended = False
        try:
            await asyncio.wait_for(old_next, 1.0)
        except StopAsyncIteration:
            ended = True
        await new.aclose()
        return got, ended

    got, old_ended = asyncio.run(main())
    assert got["a"].token_ids == [1] and old_ended


def test_a_channel_nobody_reads_is_dropped_once_abandoned_but_not_before(monkeypatch):
    from deployments.channels import step_channel

    channels = StepChannels()
    channels.register("dead", "a")
    channels.put("dead", _out("a", 1, finished=True))
    channels.end("dead", "a", delivered=True)  # its ingress died before it subscribed
    assert "dead" in channels._channels  # a live ingress may still be on its way to read it
    monkeypatch.setattr(step_channel, "ABANDONED_S", 0.0)
    channels.register("live", "b")
    channels.end("live", "b", delivered=False)  # any request's end sweeps
    assert channels._channels == {}


class _Call:
    """A request's own call as the ingress reads it: its ticket, then (held until `end` is set) its StepEnd."""

    def __init__(self, ticket, end_item, end: asyncio.Event):
        self.items, self.end_item, self.end, self.cancelled = [ticket], end_item, end, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop()
        if self.end_item is None:
            raise StopAsyncIteration
        await self.end.wait()
        item, self.end_item = self.end_item, None
        if isinstance(item, _Raise):
            raise item.exc
        return item

    def cancel(self):
        self.cancelled = True


def _reader(inbox, ticket, end_item, end):
    from deployments.channels.step_inbox import ChannelStream

    queue = inbox._queues["a"] = asyncio.Queue()
    return ChannelStream(inbox, _Call(ticket, end_item, end), "a", queue)


def test_outputs_that_wait_for_a_slow_reader_go_out_merged_and_are_counted():
    from deployments.channels.step_channel import StepEnd, StepTicket
    from deployments.channels.step_inbox import StepInbox

    async def main():
        merged = []
        inbox = StepInbox(engine=None, on_merged=merged.append)
        inbox.follow = lambda request_id, replica: None  # no decode lane here: the test feeds the queue
        end = asyncio.Event()
        stream = _reader(inbox, StepTicket("r1", _out("a", 1)), StepEnd(delivered=True), end)
        first = await stream.__anext__()
        for token in (2, 3, 4):  # three channel messages arrive before the reader comes back
            inbox._queues["a"].put_nowait(_out("a", token))
        second = await stream.__anext__()
        inbox._queues["a"].put_nowait(_out("a", 5, finished=True))
        third = await stream.__anext__()
        end.set()
        stream.cancel()
        return first, second, third, merged, inbox

    first, second, third, merged, inbox = asyncio.run(main())
    assert first.token_ids == [1] and second.token_ids == [2, 3, 4] and third.finished
    assert merged == [2] and inbox.num_merged == 2 and inbox._queues == {}


def test_a_request_the_engine_cut_short_ends_short_and_a_failure_is_raised_after_what_came_first():
    from deployments.channels.step_channel import StepEnd, StepTicket
    from deployments.channels.step_inbox import StepInbox

    async def main(end_item):
        inbox = StepInbox(engine=None)
        inbox.follow = lambda request_id, replica: None
        end = asyncio.Event()
        stream = _reader(inbox, StepTicket("r1", _out("a", 1)), end_item, end)
        got = [await stream.__anext__()]
        inbox._queues["a"].put_nowait(_out("a", 2))
        end.set()  # the call ends: cut (StepEnd not delivered) or failed (the exception the watch hands over)
        await asyncio.sleep(0.01)
        try:
            async for out in stream:
                got.append(out)
        except RuntimeError as exc:
            return got, repr(exc)
        return got, None

    cut, error = asyncio.run(main(StepEnd(delivered=False)))
    assert [o.token_ids for o in cut] == [[1], [2]] and error is None
    failed, error = asyncio.run(main(_Raise(RuntimeError("replica died"))))
    assert [o.token_ids for o in failed] == [[1], [2]] and "replica died" in error


class _Raise:
    """Stands for the call failing: `_Call` returns it, and the watch's loop raises it."""

    def __init__(self, exc):
        self.exc = exc
