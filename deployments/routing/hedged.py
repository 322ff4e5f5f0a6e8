"""A call between lanes sent again when its first copy goes unanswered: a hedged request.

Why: the prefill lane waits for its verify slots (`allocate_many`) before it hands a batch over, so
one stuck call stalls every prompt behind it. On one H200 under mixed traffic such calls reached no
verify replica for the whole 5 s wait while the replica answered everyone else in milliseconds
(benchmarks/results/lanes_1gpu_h200/before_fix/). The cause, Serve's router stranding calls that
share a request id, is fixed in deployments/routing/serve_calls.py; this bounds the stall of any stuck call
to `resend_after_s` (hundreds of times the usual answer time), and logs it.

A copy that answers after the winner may hold something (slots handed out): `discard` gives it
back. A copy still unanswered when the caller stops waiting is cancelled after `SETTLE_S` more:
a Serve call cancelled before it reached a replica holds nothing, and one that ran has answered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

SETTLE_S = 60.0  # how long a losing copy may still answer (and have what it holds given back)


async def hedged(call: Callable[[], Awaitable[T]], *, resend_after_s: float, deadline_s: float,
                 discard: Callable[[T], Awaitable[None]] | None = None,
                 on_resend: Callable[[int], None] | None = None) -> T:
    """The first answer of `call()`, sent again every `resend_after_s` while no copy has answered,
    for at most `deadline_s` (then TimeoutError). An error is an answer: it is raised at once."""
    start_s = time.monotonic()
    copies: list[asyncio.Future] = []
    try:
        while True:
            copies.append(asyncio.ensure_future(call()))
            left_s = deadline_s - (time.monotonic() - start_s)
            done, _ = await asyncio.wait(copies, timeout=max(0.0, min(resend_after_s, left_s)),
                                         return_when=asyncio.FIRST_COMPLETED)
            if done:
                winner = done.pop()
                copies.remove(winner)
                return winner.result()
            if left_s <= resend_after_s:
                raise TimeoutError(f"no answer in {deadline_s:g} s from {len(copies)} copies of the call")
            if on_resend is not None:
                on_resend(len(copies))
    finally:
        for copy in copies:  # losers: give back what they hold, once they answer
            asyncio.ensure_future(_settle(copy, discard))


async def _settle(copy: asyncio.Future, discard) -> None:
    try:
        result = await asyncio.wait_for(asyncio.shield(copy), SETTLE_S)
    except TimeoutError:
        copy.cancel()
        return
    except BaseException:  # noqa: BLE001 - it failed or was cancelled: it holds nothing
        return
    if discard is not None:
        try:
            await discard(result)
        except Exception as exc:  # noqa: BLE001 - the replica went since: what it held went with it
            log.info("giving back what a late copy of a call got failed: %s", exc)
