"""The controller's concurrent read of its lanes (controller/actor.py `gather_or_cancel`).

A decision reads the DecodeLane and the VerifyLane at once. When one read fails at once (a lane still
loading answers DeploymentUnavailableError), the other must not run on to its 10 s timeout behind the
next decision's reads.
"""

import asyncio
import time

import pytest

from controller.actor import gather_or_cancel


class LaneLoading(Exception):
    pass


async def _fails_at_once() -> list:
    raise LaneLoading("the verify lane is still loading")


def test_the_results_come_in_the_order_given():
    async def after(delay_s: float, value: str) -> str:
        await asyncio.sleep(delay_s)
        return value

    assert asyncio.run(gather_or_cancel(after(0.05, "decode"), after(0.0, "verify"))) == ["decode", "verify"]


def test_a_failing_read_cancels_the_other_and_raises_its_own_error():
    other: dict = {}

    async def slow_read() -> list:
        other["started"] = True
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            other["cancelled"] = True
            raise
        return []

    async def decision() -> float:
        began = time.monotonic()
        with pytest.raises(LaneLoading):
            await gather_or_cancel(slow_read(), _fails_at_once())
        return time.monotonic() - began

    took_s = asyncio.run(decision())
    assert other == {"started": True, "cancelled": True}
    assert took_s < 2.0  # not the slow read's 10 s


def test_cancelling_the_decision_cancels_both_reads():
    cancelled: list[str] = []

    async def read(lane: str) -> list:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(lane)
            raise
        return []

    async def main() -> None:
        decision = asyncio.ensure_future(gather_or_cancel(read("decode"), read("verify")))
        await asyncio.sleep(0.05)
        decision.cancel()
        with pytest.raises(asyncio.CancelledError):
            await decision

    asyncio.run(main())
    assert sorted(cancelled) == ["decode", "verify"]
