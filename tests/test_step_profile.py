"""StepProfile (lanes/engine/step_profile.py): steps counted by what they launched, stalls apart."""

from dataclasses import replace

from lanes.engine.step_profile import STALL_STEP_MS, StepProfile


def test_steps_are_split_by_prefill_and_stalls_are_counted_apart():
    profile = StepProfile()
    profile.observe(rows=4, prefill_tokens=0, step_ms=10.0)
    profile.observe(rows=4, prefill_tokens=128, step_ms=20.0)
    earlier = replace(profile)
    profile.observe(rows=2, prefill_tokens=0, step_ms=STALL_STEP_MS + 50)  # a capture or a compile
    profile.observe(rows=2, prefill_tokens=64, step_ms=30.0)

    assert profile.summary()["stall_steps"] == 1 and profile.summary()["stall_ms"] == STALL_STEP_MS + 50
    later = profile.since(earlier).summary()
    assert later == {"steps": 2, "prefill_steps_share": 0.5, "prefill_tokens_per_prefill_step": 64.0,
                     "rows_mean": 2.0, "decode_only_step_ms": STALL_STEP_MS + 50, "prefill_step_ms": 30.0,
                     "stall_steps": 1, "stall_ms": STALL_STEP_MS + 50}
    assert StepProfile().summary()["decode_only_step_ms"] is None  # no step of that kind
