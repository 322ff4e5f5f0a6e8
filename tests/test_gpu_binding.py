"""Which GPUs a lane replica sees, and which KV transport follows from where two replicas are.

The peer copy itself needs two GPUs (benchmarks/dual_gpu.py runs it); here Ray's side is real:
two fake GPUs, replicas started with and without `kv_peer_access`'s environment."""

import pytest
import ray
from pydantic import ValidationError

from deployments.config import AppConfig, LaneConfig
from deployments.placement.gpu_binding import (MPS_PRIORITY_ENV, MPS_SM_PERCENT_ENV, NOSET_ENV, lane_device,
                                               own_gpu_first, peer_access_env)
from deployments.placement.kv_transfer import Placement


def test_own_gpu_is_listed_first_and_the_others_keep_their_order():
    assert own_gpu_first("0", ["0", "1"]) == "0,1"
    assert own_gpu_first("1", ["0", "1"]) == "1,0"
    assert own_gpu_first("5", ["4", "5", "6", "7"]) == "5,4,6,7"  # a node started with CUDA_VISIBLE_DEVICES
    with pytest.raises(ValueError):
        own_gpu_first("2", ["0", "1"])


def test_only_gpu_lanes_of_apps_with_peer_access_keep_ray_out_of_cuda_visible_devices():
    assert peer_access_env(0.5, True) == {NOSET_ENV: "1"}
    assert peer_access_env(0, True) == {}
    assert peer_access_env(1, False) == {}
    lane = LaneConfig(num_gpus=0.3)
    assert lane.deployment_options(peer_access=True)["ray_actor_options"]["runtime_env"] == {
        "env_vars": {NOSET_ENV: "1"}}
    assert "runtime_env" not in lane.deployment_options(peer_access=False)["ray_actor_options"]
    assert "runtime_env" not in LaneConfig().deployment_options(peer_access=True)["ray_actor_options"]  # CPU lane
    assert AppConfig().kv_peer_access and not AppConfig(kv_peer_access=False).kv_peer_access


def test_under_mps_the_prefill_lane_runs_below_the_others_unless_its_config_says_otherwise():
    from deployments.builder import _options

    env = lambda opts: opts["ray_actor_options"].get("runtime_env", {}).get("env_vars", {})  # noqa: E731
    cfg = AppConfig(mode="pdv", kv_peer_access=False, prefill_lane={"num_gpus": 0.3}, decode_lane={"num_gpus": 0.1},
                    verify_lane={"num_gpus": 0.5})
    assert env(_options(cfg, "prefill_lane")) == {MPS_PRIORITY_ENV: "1"}
    assert env(_options(cfg, "decode_lane")) == {} and env(_options(cfg, "verify_lane")) == {}
    assert env(_options(cfg.model_copy(update={"prefill_lane": LaneConfig(num_gpus=0.3, mps_priority="normal")}),
                        "prefill_lane")) == {}
    assert env(_options(cfg.model_copy(update={"verify_lane": LaneConfig(num_gpus=0.5, mps_priority="below_normal")}),
                        "verify_lane")) == {MPS_PRIORITY_ENV: "1"}
    assert env(_options(AppConfig(mode="pd", kv_peer_access=False), "prefill_lane")) == {}  # a CPU lane: no GPU to share
    with_peers = AppConfig(mode="pd", prefill_lane={"num_gpus": 0.3})
    assert env(_options(with_peers, "prefill_lane")) == {NOSET_ENV: "1", MPS_PRIORITY_ENV: "1"}


def test_under_mps_a_lane_capped_to_a_share_of_sms_says_so_in_its_environment():
    from deployments.builder import _options

    env = lambda opts: opts["ray_actor_options"].get("runtime_env", {}).get("env_vars", {})  # noqa: E731
    cfg = AppConfig(mode="pd", kv_peer_access=False, prefill_lane={"num_gpus": 0.3, "mps_sm_percent": 60},
                    decode_lane={"num_gpus": 0.6})
    assert env(_options(cfg, "prefill_lane")) == {MPS_PRIORITY_ENV: "1", MPS_SM_PERCENT_ENV: "60"}
    assert env(_options(cfg, "decode_lane")) == {}  # unset: no cap
    uncapped = cfg.model_copy(update={"prefill_lane": LaneConfig(num_gpus=0.3, mps_sm_percent=100)})
    assert env(_options(uncapped, "prefill_lane")) == {MPS_PRIORITY_ENV: "1"}
    on_cpu = cfg.model_copy(update={"prefill_lane": LaneConfig(mps_sm_percent=60)})
    assert env(_options(on_cpu, "prefill_lane")) == {}  # no GPU to share
    for bad in (0, 101):
        with pytest.raises(ValidationError):
            LaneConfig(num_gpus=0.3, mps_sm_percent=bad)


def test_outside_ray_a_lane_device_is_plain(monkeypatch):
    monkeypatch.setenv(NOSET_ENV, "1")
    assert lane_device(0) == "cpu"
    assert lane_device(1) == "cuda"


def test_transport_follows_from_placements():
    own = Placement("node-a", "gpu-0", peer_uuids=("gpu-1",))
    assert own.can_write_into(Placement("node-a", "gpu-0"))  # same GPU: in place
    assert own.can_write_into(Placement("node-a", "gpu-1"))  # a peer it sees: peer copy
    assert not own.can_write_into(Placement("node-a", "gpu-2"))  # hidden from it: through the host
    assert not own.can_write_into(Placement("node-b", "gpu-1"))  # another node
    assert not Placement("node-a", "gpu-0").can_write_into(Placement("node-a", "gpu-1"))  # Ray hid gpu-1
    assert not Placement("node-a", None).can_write_into(Placement("node-a", None))  # CPU lanes copy


@ray.remote(num_cpus=0)
class _Replica:
    def bind(self) -> tuple[str, str, list]:
        import os
        device = lane_device(1)
        return device, os.environ.get("CUDA_VISIBLE_DEVICES"), [str(i) for i in ray.get_gpu_ids()]


def _start(peer_access: bool):
    env = peer_access_env(1, peer_access)
    replicas = [_Replica.options(num_gpus=1, runtime_env={"env_vars": env}).remote() for _ in range(2)]
    results = ray.get([r.bind.remote() for r in replicas])
    for replica in replicas:
        ray.kill(replica)
    return results


def test_with_peer_access_each_replica_sees_both_gpus_its_own_first(two_fake_gpus):
    results = _start(peer_access=True)
    assert sorted(ids[0] for _, _, ids in results) == ["0", "1"]
    for device, visible, ids in results:
        assert device == "cuda"
        assert visible == ("0,1" if ids == ["0"] else "1,0")


def test_without_it_ray_shows_each_replica_only_its_own_gpu(two_fake_gpus):
    for device, visible, ids in _start(peer_access=False):
        assert device == "cuda" and visible == ids[0]


def _tiny_engine(loop=None, prefill=None, verify=None):
    """The decode replica's engine factory, as EngineServer calls it, over the tests' tiny pair (on the CPU:
    only where the engine process runs and what it is told matters here)."""
    from tests.engine_helpers import pair_engine

    return pair_engine("llama")


@ray.remote(num_cpus=0)
class _DecodeReplica:
    """A decode-lane replica as Serve runs it, with its engine in a process of its own."""

    def engine_visible_devices(self) -> tuple[str | None, list[str]]:
        from deployments.replicas.engine_replica import EngineServer

        server = EngineServer(_tiny_engine, "unified", engine_process=True, num_gpus=1)
        try:
            with open(f"/proc/{server.engine.pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        finally:
            server.engine.shutdown()
        visible = env.get(b"CUDA_VISIBLE_DEVICES")
        return visible.decode() if visible is not None else None, [str(i) for i in ray.get_gpu_ids()]


def test_each_decode_replicas_engine_process_sees_that_replicas_gpu_first(two_fake_gpus):
    """The engine process, no Ray worker, cannot ask Ray for its GPU: it inherits what its replica bound.
    Before the fix, it saw every GPU and took the first (two H200s: both replicas of a data-parallel
    app on GPU 0, benchmarks/results/dual_gpu_h200x2_before_binding_fix/)."""
    env = peer_access_env(1, True)
    replicas = [_DecodeReplica.options(num_gpus=1, runtime_env={"env_vars": env}).remote() for _ in range(2)]
    try:
        results = ray.get([r.engine_visible_devices.remote() for r in replicas], timeout=300)
    finally:
        for replica in replicas:
            ray.kill(replica)
    assert sorted(ids[0] for _, ids in results) == ["0", "1"]
    for visible, ids in results:
        assert visible == ("0,1" if ids == ["0"] else "1,0")
