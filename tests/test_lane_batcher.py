"""LaneBatcher: a batch is formed when the lane is free, from everything waiting then."""

import asyncio

import pytest

from deployments.replicas.lane_batcher import LaneBatcher


class GatedLane:
    """A lane whose forwards finish only when the test opens the gate; records each batch."""

    def __init__(self):
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.fail_next = False

    async def forward(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        await self.gate.wait()
        self.gate.clear()
        if self.fail_next:
            self.fail_next = False
            raise ValueError("forward failed")
        return [i * 10 for i in items]


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_arrivals_during_a_forward_all_join_the_next_one():
    async def scenario():
        lane = GatedLane()
        batcher = LaneBatcher(lane.forward, max_batch=8)
        first = asyncio.create_task(batcher.submit(1))
        await _settle()
        assert lane.batches == [[1]]  # an idle lane starts at once, without waiting for company
        later = [asyncio.create_task(batcher.submit(i)) for i in range(2, 7)]
        await _settle()
        assert batcher.waiting == 5 and len(lane.batches) == 1  # no batch formed while the lane is busy
        lane.gate.set()
        assert await first == 10
        await _settle()
        assert lane.batches == [[1], [2, 3, 4, 5, 6]]
        lane.gate.set()
        assert await asyncio.gather(*later) == [20, 30, 40, 50, 60]

    asyncio.run(scenario())


def test_batches_are_capped_and_keep_arrival_order():
    async def scenario():
        lane = GatedLane()
        batcher = LaneBatcher(lane.forward, max_batch=3)
        calls = [asyncio.create_task(batcher.submit(i)) for i in range(7)]
        for _ in range(4):
            await _settle()
            lane.gate.set()
        assert await asyncio.gather(*calls) == [i * 10 for i in range(7)]
        assert lane.batches == [[0, 1, 2], [3, 4, 5], [6]]

    asyncio.run(scenario())


def test_a_failed_forward_fails_its_callers_only():
    async def scenario():
        lane = GatedLane()
        batcher = LaneBatcher(lane.forward, max_batch=8)
        lane.fail_next = True
        doomed = [asyncio.create_task(batcher.submit(i)) for i in (1, 2)]
        await _settle()
        lane.gate.set()
        for call in doomed:
            with pytest.raises(ValueError, match="forward failed"):
                await call
        survivor = asyncio.create_task(batcher.submit(3))
        await _settle()
        lane.gate.set()
        assert await survivor == 30

    asyncio.run(scenario())


def test_a_cancelled_caller_is_left_out_of_the_forward():
    async def scenario():
        lane = GatedLane()
        batcher = LaneBatcher(lane.forward, max_batch=8)
        running = asyncio.create_task(batcher.submit(1))
        await _settle()
        gone = asyncio.create_task(batcher.submit(2))
        kept = asyncio.create_task(batcher.submit(3))
        await _settle()
        gone.cancel()
        await _settle()
        lane.gate.set()
        await running
        await _settle()
        lane.gate.set()
        assert await kept == 30
        assert lane.batches == [[1], [3]]

    asyncio.run(scenario())


def test_a_forward_returning_the_wrong_count_fails_the_batch():
    async def short(items):
        return items[:-1]

    async def scenario():
        batcher = LaneBatcher(short, max_batch=8)
        with pytest.raises(RuntimeError, match="a batch of 1 gave 0 results"):
            await batcher.submit(1)

    asyncio.run(scenario())
