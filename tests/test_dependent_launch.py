"""Programmatic dependent launch (lanes/model/dependent_launch.py): off wherever it cannot run, so that the
kernels' tests under Triton's interpreter, CPU serving and GPUs before Hopper launch as before. Its effect on
a GPU is measured by benchmarks/gpu_check.py (VPD_PDL=0 against 1), not here."""

import torch

from lanes.model import dependent_launch


def test_off_on_cpu_and_under_the_interpreter(monkeypatch):
    assert not dependent_launch.enabled(torch.device("cpu"))
    dependent_launch._enabled.cache_clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as tests/conftest.py sets it: no device is asked
    assert not dependent_launch._enabled(0)
    dependent_launch._enabled.cache_clear()


def test_off_unless_vpd_pdl_is_1(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for value in (None, "0", "yes"):
        dependent_launch._enabled.cache_clear()
        if value is None:
            monkeypatch.delenv("VPD_PDL", raising=False)
        else:
            monkeypatch.setenv("VPD_PDL", value)
        assert not dependent_launch._enabled(0)  # decided before any device is asked
    dependent_launch._enabled.cache_clear()


def test_the_launch_keyword_only_with_pdl():
    assert dependent_launch.launch_options(False) == {}  # Triton before 3.3 refuses an unknown keyword
    assert dependent_launch.launch_options(True) == {"launch_pdl": True}
