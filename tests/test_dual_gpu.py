"""The dual-GPU benchmark's own logic: the placement check, and that every placement config means
what it says when Ray packs it onto two GPUs (reading the timelines: tests/test_lane_timelines.py)."""

import time

import pytest
import ray

from benchmarks.dual_gpu import PLACEMENTS, as_intended, observed_gpus, placement_args, replica_gpus
from tests.timeline_helpers import lane_report


def test_observed_gpus_against_what_the_config_means():
    b = PLACEMENTS["b"]
    right = [lane_report("prefill", "p", "g0"), lane_report("decode", "d1", "g0"),
             lane_report("decode", "d2", "g0"), lane_report("verify", "v", "g1")]
    observed = observed_gpus(right, [{"index": 0, "uuid": "g0"}, {"index": 1, "uuid": "g1"}])
    assert observed["gpu_groups"] == [["decode", "decode", "prefill"], ["verify"]]
    assert [r["gpu_index"] for r in observed["replicas"]] == [0, 0, 0, 1]
    assert as_intended(b, observed)
    wrong = right[:2] + [lane_report("decode", "d2", "g1"), right[3]]
    assert not as_intended(b, observed_gpus(wrong, []))
    assert as_intended(b, observed_gpus([lane_report("verify", "v")], [])) is None  # CPU: nothing to check


@ray.remote(num_cpus=0)
class _Holder:
    def gpu_ids(self) -> list:
        return ray.get_gpu_ids()


@pytest.mark.parametrize("key", sorted(PLACEMENTS))
def test_ray_packs_each_placement_as_its_config_means(two_fake_gpus, key):
    """Ray gives fractional GPU requests the GPU they fit most tightly and whole ones a free GPU:
    the placement holds in whatever order the replicas start (here: as listed, and reversed)."""
    spec = PLACEMENTS[key]
    asked = replica_gpus(placement_args(spec, "models/vpd-target", "models/vpd-draft", "cuda"))
    for order in (asked, asked[::-1]):
        holders, reports = [], []
        for n, (lane, num_gpus) in enumerate(order):
            holder = _Holder.options(num_gpus=num_gpus).remote()
            gpu_ids = ray.get(holder.gpu_ids.remote())  # placed before the next replica asks
            holders.append(holder)
            reports.append(lane_report(lane, str(n), uuid=f"gpu-{gpu_ids[0]}"))
        assert as_intended(spec, observed_gpus(reports, [])), (order, observed_gpus(reports, [])["gpu_groups"])
        for holder in holders:
            ray.kill(holder)
        deadline = time.monotonic() + 30
        while ray.available_resources().get("GPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # the next order starts from two free GPUs
