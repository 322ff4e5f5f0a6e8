"""A lane's Serve options under `slo:` targets: autoscaling with the replica planner (controller/planner.py)
as its policy."""

import logging
import math
from dataclasses import asdict

from controller.planner import PlannerTargets
from deployments.config import AppConfig

PLANNER_POLICY = "controller.planner:LanePlanner"
log = logging.getLogger(__name__)


def lane_kind(mode: str, lane: str) -> str:
    """The planner's name for what a lane's replicas do (which latency they own)."""
    if lane == "decode_lane":
        return "decode" if mode in ("pd", "pdv") else "engine"
    return lane.removesuffix("_lane")


def planner_targets(cfg: AppConfig, lane: str) -> PlannerTargets:
    slo, controller = cfg.slo, cfg.controller
    kind = lane_kind(cfg.mode, lane)
    # The lanes whose replicas run the L that the L controller sets wait for it to shed L first.
    draft_floor = controller.min_draft_len if controller.enabled and kind != "prefill" else None
    return PlannerTargets(
        kind, ttft_p95_ms=slo.ttft_p95_ms, tpot_p95_ms=slo.tpot_p95_ms, prefill_ttft_frac=slo.prefill_ttft_frac,
        verify_tokens_per_step=slo.verify_tokens_per_step, verify_queue_high=controller.verify_queue_high,
        occupancy_high=controller.occupancy_high, scale_down_frac=slo.scale_down_frac,
        down_latency_frac=slo.down_latency_frac,
        urgent_pressure=slo.urgent_pressure, max_step_up=slo.max_step_up, draft_shed_grace_s=slo.draft_shed_grace_s,
        min_draft_len=draft_floor)


def gpu_replica_bound(cfg: AppConfig, lane: str, cluster_gpus: float) -> int | None:
    """Most replicas of `lane` that the cluster's `cluster_gpus` GPUs hold while every other GPU lane keeps
    its one replica (None: the lane takes no GPU). Ray places a replica only where its `num_gpus` per rank is
    free, and the lane's memory profile sizes each replica to that share of a GPU's memory, so a replica
    past this count would wait unplaced, and the planner, which decides nothing while a replica starts,
    with it."""
    share = getattr(cfg, lane).num_gpus * cfg.lane_ranks(lane)
    if share <= 0:
        return None
    others = sum(getattr(cfg, other).num_gpus * cfg.lane_ranks(other) for other in cfg.lanes if other != lane)
    # Ray counts GPU shares in units of 1e-4: 1 / 3 of a GPU three times is one GPU.
    return max(1, math.floor((cluster_gpus - others) / share + 1e-4))


def planner_options(cfg: AppConfig, lane: str, opts: dict, cluster_gpus: float | None = None) -> dict:
    """`opts` (the lane's Serve options) with the planner's autoscaling_config in place of num_replicas. The
    lane's own autoscaling_config overrides the planner's bounds and delays; a `policy` in it replaces
    the planner. `cluster_gpus`: the GPUs of the cluster the app runs on (None: GPU nodes start on
    demand); a GPU lane's max_replicas is then at most what they hold (`gpu_replica_bound`)."""
    slo, config = cfg.slo, getattr(cfg, lane)
    start = config.num_replicas or 1
    autoscaling = {
        "min_replicas": 1, "max_replicas": slo.max_replicas, "initial_replicas": start,
        "upscale_delay_s": slo.upscale_delay_s, "downscale_delay_s": slo.downscale_delay_s,
        "metrics_interval_s": slo.metrics_interval_s, "look_back_period_s": slo.look_back_period_s,
        "policy": {"policy_function": PLANNER_POLICY, "policy_kwargs": asdict(planner_targets(cfg, lane))},
        **(config.autoscaling_config or {}),
    }
    bound = gpu_replica_bound(cfg, lane, cluster_gpus) if cluster_gpus is not None else None
    if bound is not None and autoscaling["max_replicas"] > bound:
        log.info("%s: max_replicas %d -> %d, what %g GPU(s) hold at num_gpus %g", lane, autoscaling["max_replicas"],
                 bound, cluster_gpus, config.num_gpus)
        autoscaling["max_replicas"] = bound
        autoscaling["initial_replicas"] = min(autoscaling.get("initial_replicas") or 1, bound)
    opts = {k: v for k, v in opts.items() if k != "num_replicas"} | {"autoscaling_config": autoscaling}
    if lane == "decode_lane":
        # A decode replica holds its requests' streams: scaled down, it stops taking requests and finishes
        # those it has (Serve's graceful shutdown) for as long as a request may run.
        opts["graceful_shutdown_timeout_s"] = cfg.request_timeout_s
    return opts
