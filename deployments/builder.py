"""`build_app(args) -> Application`: validate the config once, then bind the graph of its mode."""

from functools import partial

import ray
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from transformers import AutoConfig, AutoTokenizer

from lanes.model.families import UnsupportedModelError
from lanes.parallel.tensor_parallel import check_shardable

from controller.actor import ControllerDeployment
from deployments.api.ingress import IngressDeployment
from deployments.config import DEFAULT_MPS_PRIORITY, AppConfig
from deployments.factories import (build_engine, build_prompt_prefiller, build_verify_lane, load_prefill_shards,
                                   load_shards, load_verify_shards)
from deployments.planning import planner_options
from deployments.replicas.engine_replica import EngineDeployment
from deployments.replicas.prefill_replica import PrefillDeployment
from deployments.replicas.tp_workers import start_shard_workers
from deployments.replicas.verify_replica import VerifyDeployment
from deployments.routing.lease_router import LeaseRouter


# Calls a decode replica takes beyond max_ongoing_requests under `stream_channel: step`: room for the
# subscriptions of this many ingress replicas.
SUBSCRIPTION_HEADROOM = 16


class ConfigError(ValueError):
    """The app config cannot run here (checked before anything is deployed)."""


def build_app(args: dict | AppConfig | None = None) -> Application:
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    check_pair(cfg)
    check_tensor_parallel(cfg)
    gpus = cluster_gpus(cfg)  # one query of the cluster: the check and the planner's bounds read it
    check_gpus(cfg, gpus)
    check_resources(cfg)
    check_controller(cfg)
    verify = prefill = None
    if cfg.mode == "pdv":
        verify = VerifyDeployment.options(**_options(cfg, "verify_lane", gpus)).bind(
            partial(build_verify_lane, cfg), cfg.mode, start_workers=_workers(cfg, "verify_lane", load_verify_shards),
            prefill_tokens=cfg.engine.prefill_chunk_tokens if cfg.local_prefill_max_tokens else 0)
    if cfg.mode in ("pd", "pdv"):
        prefill = PrefillDeployment.options(**_options(cfg, "prefill_lane", gpus)).bind(
            partial(build_prompt_prefiller, cfg), cfg.mode, verify,
            start_workers=_workers(cfg, "prefill_lane", load_prefill_shards))
    engine = EngineDeployment.options(**_decode_options(cfg, gpus)).bind(
        partial(build_engine, cfg), cfg.mode, prefill=prefill, verify=verify,
        stream_interval_s=cfg.stream_interval_ms / 1e3, max_stream_messages_per_s=cfg.max_stream_messages_per_s,
        engine_process=cfg.engine_process, start_workers=_workers(cfg, "decode_lane", load_shards),
        peer_timeout_s=cfg.request_timeout_s, num_gpus=cfg.decode_lane.num_gpus)
    controller = None
    if cfg.controller.enabled:
        slo = cfg.slo.model_dump() if cfg.slo is not None else None
        controller = ControllerDeployment.bind(cfg.controller.model_dump(), cfg.mode, engine, verify, slo=slo)
    return IngressDeployment.options(**cfg.ingress.deployment_options()).bind(engine, cfg.model_dump(), controller,
                                                                              prefill=prefill, verify=verify)


def _options(cfg: AppConfig, lane: str, gpus: float | None = None) -> dict:
    """`gpus`: `cluster_gpus(cfg)`, read once for the whole app (None: no planner bound from the GPUs)."""
    opts = getattr(cfg, lane).deployment_options(cfg.kv_peer_access, cfg.lane_ranks(lane),
                                                 DEFAULT_MPS_PRIORITY.get(lane, "normal"))
    return planner_options(cfg, lane, opts, gpus) if cfg.slo is not None else opts


def _decode_options(cfg: AppConfig, gpus: float | None) -> dict:
    """The decode lane's; with `stream_channel: step` its router takes an ingress's subscription to the
    replica it names (`lease=`), and any other call as it would."""
    opts = _options(cfg, "decode_lane", gpus)
    if cfg.stream_channel == "step":
        opts["request_router_config"] = RequestRouterConfig(request_router_class=LeaseRouter)
        # Each ingress replica's subscription is a call too: one that waited behind requests whose chunks it
        # carries would hold their streams until one ended.
        opts["max_ongoing_requests"] += SUBSCRIPTION_HEADROOM
    return opts


def _workers(cfg: AppConfig, lane: str, load):
    """What starts the worker ranks of a replica of `lane` where it holds a sharded target, else None."""
    return partial(start_shard_workers, cfg, lane, partial(load, cfg)) if cfg.lane_ranks(lane) > 1 else None


def check_pair(cfg: AppConfig) -> None:
    """Refuse, before loading weights anywhere, a draft whose token ids mean something else."""
    draft = cfg.draft_model
    if draft is None:  # no speculation, or prompt lookup: the target's own ids are drafted
        return
    target_tok, draft_tok = AutoTokenizer.from_pretrained(cfg.target.path), AutoTokenizer.from_pretrained(draft.path)
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ConfigError(f"tokenizers of target {cfg.target.path!r} and draft {draft.path!r} differ")
    target_vocab = AutoConfig.from_pretrained(cfg.target.path).get_text_config().vocab_size
    draft_vocab = AutoConfig.from_pretrained(draft.path).get_text_config().vocab_size
    if target_vocab != draft_vocab:
        raise ConfigError(f"target has {target_vocab} logits, draft {draft_vocab}")


def check_tensor_parallel(cfg: AppConfig) -> None:
    """Refuse, from the model configs, a model its tensor_parallel_size cannot shard exactly."""
    specs = [cfg.target] + ([cfg.draft_model] if cfg.shard_draft else [])
    for spec in specs:
        try:
            check_shardable(AutoConfig.from_pretrained(spec.path), spec.tensor_parallel_size)
        except UnsupportedModelError as exc:
            raise ConfigError(f"{spec.path}: {exc}") from exc


def check_controller(cfg: AppConfig) -> None:
    # Without a draft model every L is clamped to 0: the controller would push forever and change nothing.
    if cfg.controller.enabled and cfg.mode == "nospec":
        raise ConfigError("controller.enabled needs a draft model; mode 'nospec' has none")


def _connect() -> None:
    """Join the Ray cluster the app is built for (`serve run` starts one where none runs)."""
    if not ray.is_initialized():
        ray.init(include_dashboard=False)


def check_resources(cfg: AppConfig) -> None:
    """A lane pinned by custom resources to nodes that no node offers would wait forever: fail now instead."""
    wanted = [(lane, name, amount * cfg.lane_ranks(lane)) for lane in cfg.lanes
              for name, amount in getattr(cfg, lane).resources.items()]
    if not wanted or not cfg.require_gpus_present:
        return
    _connect()
    # Per node, not summed: one replica's resources must all be on one node.
    offered = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    for lane, name, amount in wanted:
        most = max((resources.get(name, 0) for resources in offered), default=0)
        if most < amount:
            raise ConfigError(f"{lane}.resources asks for {name}={amount:g} but no node of the Ray cluster offers "
                              f"it (the most on one node: {most:g}); start nodes with it, or set "
                              "require_gpus_present: false where the autoscaler starts such nodes on demand")


def cluster_gpus(cfg: AppConfig) -> float | None:
    """The GPUs of the Ray cluster the app runs on, where a lane asks for some (None: none does, or
    `require_gpus_present` is off: GPU nodes start on demand)."""
    if not cfg.require_gpus_present or not any(getattr(cfg, lane).num_gpus > 0 for lane in cfg.lanes):
        return None
    _connect()
    return ray.cluster_resources().get("GPU", 0)


def check_gpus(cfg: AppConfig, have: float | None) -> None:
    """A lane that asks for GPUs the cluster lacks would wait forever to be placed: fail now instead.
    `have`: `cluster_gpus(cfg)`."""
    if have is None:
        return
    # A replica that holds a sharded target takes its lane's GPU share once per rank.
    wanted = [(lane, getattr(cfg, lane).num_gpus, cfg.lane_ranks(lane)) for lane in cfg.lanes
              if getattr(cfg, lane).num_gpus > 0]
    largest = max(g * n for _, g, n in wanted)
    if have == 0 or largest > have:
        asks = ", ".join(f"{lane}.num_gpus={g}" + (f" on each of {n} ranks" if n > 1 else "") for lane, g, n in wanted)
        raise ConfigError(f"config asks for GPUs ({asks}) but the Ray cluster has {have:g} GPU(s). Set every "
                          "num_gpus to 0 to run on CPU, or require_gpus_present: false on an autoscaling cluster "
                          "whose GPU nodes start on demand.")
