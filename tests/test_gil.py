"""The switch interval of processes whose GPU-launching thread shares the GIL (lanes/device/gil.py)."""

import sys

import pytest
import torch

from deployments.lane_worker import LaneWorker
from lanes.device.gil import SWITCH_INTERVAL_S, switch_interval_s


@pytest.fixture
def restore_switch_interval():
    saved = sys.getswitchinterval()
    yield
    sys.setswitchinterval(saved)


def test_a_lane_worker_sets_its_process_switch_interval(restore_switch_interval, monkeypatch):
    monkeypatch.delenv("VPD_SWITCH_INTERVAL_MS", raising=False)
    sys.setswitchinterval(0.005)
    LaneWorker("prefill", torch.device("cpu"), 0)
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)


def test_the_environment_overrides_the_interval(restore_switch_interval, monkeypatch):
    monkeypatch.setenv("VPD_SWITCH_INTERVAL_MS", "5")
    assert switch_interval_s() == pytest.approx(0.005)
    LaneWorker("verify", torch.device("cpu"), 0)
    assert sys.getswitchinterval() == pytest.approx(0.005)


@pytest.mark.parametrize("value", ["fast", "0", "-1"])
def test_a_bad_override_names_the_variable(value, monkeypatch):
    monkeypatch.setenv("VPD_SWITCH_INTERVAL_MS", value)
    with pytest.raises(ValueError, match="VPD_SWITCH_INTERVAL_MS"):
        switch_interval_s()
