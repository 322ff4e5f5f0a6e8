"""The verify lane scales in the YAML like every other lane, and its deployment routes by lease."""

from deployments.config import AppConfig
from deployments.lease_router import LeaseRouter
from deployments.verify_replica import VerifyDeployment


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
