"""The soak run's memory sampler (loadtest/memory.py): which processes it watches, what it reads, and
the growth it reports."""

import os

import pandas as pd

from loadtest.memory import growth, processes, rss_mib

LANES = {"mode": "unified", "ingress_pid": 10, "lanes": {
    "decode": {"replicas": [{"replica_pid": 11, "engine_pid": 12}, {"replica_pid": 13, "engine_pid": 13}]},
    "verify": {"error": "RayActorError: gone"},
}}


def test_every_process_of_the_app_is_named_by_lane_and_pid():
    # A decode replica that steps its engine in a process of its own shows two processes; one that
    # steps it on a thread, one; a lane being replaced (an error instead of replicas) none.
    assert processes(LANES) == {"ingress:10": 10, "decode:11": 11, "engine:12": 12, "decode:13": 13}


def test_rss_is_read_from_proc_and_a_gone_process_gives_none():
    mine = rss_mib(os.getpid())
    assert mine is not None and 10 < mine < 100_000
    assert rss_mib(2**22 + 12345) is None


def test_growth_is_measured_from_the_end_of_warm_up():
    frame = pd.DataFrame({"t_s": [0, 60, 120, 180, 0, 60, 120],
                          "process": ["a"] * 4 + ["b"] * 3,
                          "rss_mib": [100.0, 200.0, 205.0, 210.0, 50.0, 50.0, 50.0], "gpu_mib": [None] * 7})
    out = growth(frame, warmup_s=60)
    assert out["a"]["rss_after_warmup_mib"] == 200.0 and out["a"]["growth_frac"] == 0.05
    assert out["a"]["rss_peak_mib"] == 210.0 and out["a"]["samples"] == 3
    assert out["b"]["growth_frac"] == 0.0
