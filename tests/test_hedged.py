"""deployments/routing/hedged.py: a call sent again while unanswered; the first answer wins, late ones are given
back."""

import asyncio
import time

import pytest

from deployments.routing import hedged as hedged_module
from deployments.routing.hedged import hedged


class Calls:
    """Copies of one call: copy i answers `answers[i]` after `delays_s[i]` (None: never)."""

    def __init__(self, delays_s, answers):
        self.delays_s, self.answers, self.sent, self.cancelled = delays_s, answers, 0, 0

    def __call__(self):
        i = self.sent
        self.sent += 1
        return self._answer(i)

    async def _answer(self, i):
        try:
            if self.delays_s[i] is None:
                await asyncio.Event().wait()
            await asyncio.sleep(self.delays_s[i])
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if isinstance(self.answers[i], Exception):
            raise self.answers[i]
        return self.answers[i]


def test_a_stuck_first_copy_is_sent_again_and_its_late_answer_given_back():
    async def main():
        calls, given_back, resends = Calls([0.5, 0.01], ["late", "second"]), [], []

        async def discard(result):
            given_back.append(result)
        start_s = time.monotonic()
        result = await hedged(calls, resend_after_s=0.1, deadline_s=5.0, discard=discard, on_resend=resends.append)
        took_s = time.monotonic() - start_s
        await asyncio.sleep(0.6)  # the first copy answers late
        return result, took_s, calls.sent, resends, given_back
    result, took_s, sent, resends, given_back = asyncio.run(main())
    assert result == "second" and sent == 2 and resends == [1]
    assert 0.1 <= took_s < 0.4
    assert given_back == ["late"]


def test_an_answer_in_time_sends_one_copy():
    calls = Calls([0.01], [("lease", [3], [[7]])])
    assert asyncio.run(hedged(calls, resend_after_s=1.0, deadline_s=5.0)) == ("lease", [3], [[7]])
    assert calls.sent == 1


def test_an_error_is_an_answer_and_raised_at_once():
    calls = Calls([0.01, 0.01], [ValueError("pool full"), "never asked"])
    with pytest.raises(ValueError, match="pool full"):
        asyncio.run(hedged(calls, resend_after_s=1.0, deadline_s=5.0))
    assert calls.sent == 1


def test_copies_that_never_answer_time_out_by_the_deadline_and_are_cancelled_after_settling(monkeypatch):
    monkeypatch.setattr(hedged_module, "SETTLE_S", 0.2)

    async def main():
        calls = Calls([None] * 10, [None] * 10)
        start_s = time.monotonic()
        with pytest.raises(TimeoutError, match="no answer in 0.35 s"):
            await hedged(calls, resend_after_s=0.1, deadline_s=0.35)
        took_s = time.monotonic() - start_s
        await asyncio.sleep(0.4)  # past SETTLE_S: the stuck copies are cancelled
        return calls, took_s
    calls, took_s = asyncio.run(main())
    assert 0.35 <= took_s < 0.6
    assert calls.sent == 4 and calls.cancelled == 4
