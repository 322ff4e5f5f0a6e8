"""The verify lane scales in the YAML like every other lane, and its deployment routes by lease."""

import subprocess
import sys
from pathlib import Path

from deployments.config import AppConfig
from deployments.replicas.verify_replica import VerifyDeployment
from deployments.routing.lease_router import LeaseRouter


def test_verify_lane_takes_num_replicas_and_autoscaling_like_any_lane():
    fixed = AppConfig(mode="pdv", verify_lane={"num_replicas": 3})
    assert fixed.verify_lane.deployment_options()["num_replicas"] == 3
    autoscaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    scaled = AppConfig(mode="pdv", verify_lane={"num_replicas": None, "autoscaling_config": autoscaling})
    options = scaled.verify_lane.deployment_options()
    assert options["autoscaling_config"] == autoscaling and "num_replicas" not in options


def test_every_handle_to_the_verify_lane_routes_by_lease():
    config = VerifyDeployment._deployment_config.request_router_config
    assert config.get_request_router_class() is LeaseRouter
    # The builder's options (from LaneConfig) leave the router in place.
    opts = AppConfig(mode="pdv", verify_lane={"num_replicas": 3}).verify_lane.deployment_options()
    rebound = VerifyDeployment.options(**opts)
    assert rebound._deployment_config.request_router_config.get_request_router_class() is LeaseRouter
    assert rebound._deployment_config.num_replicas == 3


def test_a_router_shipped_by_value_raises_the_lease_gone_its_callers_catch():
    """Serve ships the router's module by value: every other process that routes to the verify lane runs a copy of
    the class. What the copy raises for a gone lease is still deployments.routing.leases.LeaseGone, so
    `except LeaseGone` holds in an app declared by `serve deploy` too (tests/test_verify_replicas_serve.py kills a
    replica of one)."""
    blob = VerifyDeployment._deployment_config.request_router_config.get_serialized_request_router_cls()
    # Unpickled in this process, cloudpickle would hand back the class it pickled: another process gets a copy.
    other_process = subprocess.run([sys.executable, "-c", _ROUTE_TO_A_GONE_LEASE], input=blob, capture_output=True,
                                   cwd=Path(__file__).resolve().parents[1], check=True, timeout=120)
    assert other_process.stdout.decode().split() == ["copy", "LeaseGone", "caught"], other_process.stdout


_ROUTE_TO_A_GONE_LEASE = """
import concurrent.futures, sys
from types import SimpleNamespace
from ray import cloudpickle
import deployments.routing.lease_router
from deployments.routing.leases import LeaseGone
shipped = cloudpickle.loads(sys.stdin.buffer.read())
print("copy" if shipped is not deployments.routing.lease_router.LeaseRouter else "original")
pending = SimpleNamespace(future=concurrent.futures.Future())
assert shipped._fail(pending, ["a replica"], "verify replica x is gone") == [["a replica"]]
error = pending.future.exception(timeout=0)
print(type(error).__name__, "caught" if isinstance(error, LeaseGone) else "missed")
"""
