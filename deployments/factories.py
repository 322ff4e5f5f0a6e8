"""Building each lane's objects from the app config. The builder binds these (as partials) into the
deployments, which call them in their replicas; tests can bind their own."""

import asyncio
import logging
import uuid
from dataclasses import replace

import torch

from deployments.channels.peer_calls import PrefillLaneClient, ServeLink
from deployments.channels.remote import LinkedVerifier, RemotePrefiller, RemoteVerifier
from deployments.channels.verify_prefill import VerifyLanePrefiller
from deployments.config import AppConfig, LaneConfig
from deployments.placement.kv_transfer import Placement
from lanes.device.streams import LaneStreams
from lanes.engine.backends import LocalPrefiller, LocalVerifier
from lanes.engine.core import EngineConfig, EngineCore, build_runner, build_runners, eos_token_ids
from lanes.engine.split_prefill import SplitPrefiller
from lanes.model.loader import LoadedModel, Vocabulary, check_compatible, load_model, load_vocabulary
from lanes.parallel.kv_handover import ShardedKVPool
from lanes.parallel.tensor_parallel import TPGroup, init_group
from lanes.spec.ngram import NgramProposer
from lanes.spec.prefill import PrefillLane
from lanes.spec.prompt_prefiller import PromptPrefiller
from lanes.spec.verify import VerifyLane

PREFILL_BATCH_MAX = 8  # prompts per prefill forward batch; also the prefill lane's scratch slots


def _lane_logs_to_replica_log() -> None:
    """lanes/ logs what a replica's operator needs at start (its memory plan, its graph captures), and
    deployments/ what goes wrong between lanes (a peer call unanswered, rows shed, a step retried):
    send those INFO lines to the replica's log file, through Serve's handlers. Without this they go
    to the root logger, whose output in a Ray worker ends in the worker's stderr file, not the
    replica's log where an operator looks."""
    serve_handlers = logging.getLogger("ray.serve").handlers  # none outside a replica (tests in process)
    for name in ("lanes", "deployments"):
        ours = logging.getLogger(name)
        if serve_handlers and not ours.handlers:
            ours.setLevel(logging.INFO)
            for handler in serve_handlers:
                ours.addHandler(handler)


def _target(cfg: AppConfig, device: str) -> LoadedModel:
    return load_model(cfg.target.path, cfg.target.dtype, device, _slot_capacity(cfg))


def _draft(cfg: AppConfig, device: str) -> LoadedModel | None:
    """The draft model, where the mode drafts with one (prompt lookup and nospec load none)."""
    spec = cfg.draft_model
    return load_model(spec.path, spec.dtype, device, _slot_capacity(cfg)) if spec is not None else None


def _allows_tokenizer_mismatch(cfg: AppConfig) -> bool:
    return cfg.draft_model is not None and cfg.draft_model.allow_tokenizer_mismatch


def _check_pair(cfg: AppConfig, draft: LoadedModel | None, target: LoadedModel) -> None:
    if draft is not None:
        check_compatible(draft, target, _allows_tokenizer_mismatch(cfg))


def _rank0(cfg: AppConfig, tp_address: str | None, device: str) -> TPGroup | None:
    """Join the replica's tensor-parallel group as rank 0 where it has one (`tp_address`: where its
    worker ranks meet, deployments/replicas/tp_workers.py)."""
    return init_group(0, cfg.tensor_parallel_size, tp_address, device) if tp_address else None


def _slot_capacity(cfg: AppConfig) -> int:
    return cfg.engine.engine_config(cfg.mode).slot_capacity_tokens


def build_proposer(cfg: AppConfig, device: str | torch.device) -> NgramProposer | None:
    """The prompt-lookup proposer where the config drafts by it (else the draft model, or nothing, drafts)."""
    spec = cfg.ngram
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, device) if spec is not None else None


def _engine_config(cfg: AppConfig, lane: LaneConfig, name: str) -> EngineConfig:
    """The engine config of one lane's replica. A replica with a fraction of a GPU sizes its KV
    pools from that fraction of the device's memory (lanes share GPUs in pd and pdv)."""
    config = cfg.engine.engine_config(cfg.mode)
    share = min(1.0, lane.num_gpus) if lane.num_gpus > 0 else 1.0
    draft = cfg.draft_model
    return replace(config, gpu_memory_utilization=config.gpu_memory_utilization * share, lane_name=name,
                   draft_quantization=draft.quantization if draft is not None else None)


def _decode_lane_name(cfg: AppConfig) -> str:
    return "decode lane" if cfg.mode in ("pd", "pdv") else f"{cfg.mode} engine"


def build_engine(cfg: AppConfig, loop: asyncio.AbstractEventLoop | None, prefill=None, verify=None,
                 tp_address: str | None = None, peer_link=None) -> EngineCore:
    """The engine of the decode-lane replica (or of the only replica, in one-deployment modes).
    `tp_address`: where the ranks of a tensor-parallel engine meet (deployments/replicas/tp_workers.py); the
    engine is rank 0. pd's and pdv's engine reach their other lanes through `prefill` and `verify` (their
    Serve handles, the engine stepping on a thread of the replica whose event loop is `loop`) or, built
    in an engine process of its own, through `peer_link` (lanes/engine/process.py PeerLink)."""
    _lane_logs_to_replica_log()
    device = cfg.decode_lane.bind_device()
    config = _engine_config(cfg, cfg.decode_lane, _decode_lane_name(cfg))
    if cfg.mode in ("unified", "spec", "nospec"):
        tp = _rank0(cfg, tp_address, device)
        # A sharded model loads on the host; only its shard moves to the device (build_runners).
        core = EngineCore.colocated(_target(cfg, "cpu" if tp else device),
                                    _draft(cfg, "cpu" if tp and cfg.shard_draft else device), config,
                                    proposer=build_proposer(cfg, device),
                                    allow_tokenizer_mismatch=_allows_tokenizer_mismatch(cfg),
                                    tp=tp, shard_draft=cfg.shard_draft)
        core.capture_graphs()  # before the first request, not during it
        core.measure_forward_costs()
        return core
    draft = _draft(cfg, device)
    placement = Placement.here(device)
    if peer_link is not None and peer_link.node_id is not None:  # an engine process is no Ray worker
        placement = replace(placement, node_id=peer_link.node_id)
    owner = f"decode-{uuid.uuid4().hex[:8]}"
    if cfg.mode == "pd":
        # pd's decode lane holds the target: sharded over the replica's ranks where it is (the draft
        # runs whole on rank 0), and its pool then takes each prompt's KV through Ray
        # (lanes/parallel/kv_handover.py).
        tp = _rank0(cfg, tp_address, device)
        target = _target(cfg, "cpu" if tp else device)
        _check_pair(cfg, draft, target)
        target_runner, draft_runner = build_runners(config, target.model, draft.model if draft is not None else None,
                                                    tp=tp, sharded=(True, False))
        verifier, target_pool = LocalVerifier(VerifyLane(target_runner)), target_runner.pool
        vocab = Vocabulary(target_runner.vocab_size, target.tokenizer, target.model.generation_config)
        model_device = target_runner.device
    else:  # pdv: the target lives in the verify lane
        draft_runner = build_runner(draft.model, config, draft=True) if draft is not None else None
        if peer_link is not None:  # an engine process: batches over channels, or relayed by its replica
            verifier = LinkedVerifier(peer_link, cfg.request_timeout_s, cfg.uses_verify_channel,
                                      (config.max_num_seqs, config.max_draft_len) if cfg.uses_shared_drafts else None)
        else:
            verifier = RemoteVerifier(verify, loop, cfg.request_timeout_s)
        target_pool = None
        vocab = (Vocabulary(draft_runner.vocab_size, draft.tokenizer, draft.model.generation_config)
                 if draft is not None else load_vocabulary(cfg.target.path))
        # pdv by prompt lookup holds no model here: its drafts go to the verify lane from the host.
        model_device = draft_runner.device if draft_runner is not None else torch.device("cpu")
    link = peer_link if peer_link is not None else ServeLink(PrefillLaneClient(prefill), loop,
                                                             verify=verifier if cfg.mode == "pdv" else None)
    prefiller = RemotePrefiller(link, draft_runner.pool if draft_runner else None, target_pool, placement, owner)
    # The decode lane drafts (and in pd also verifies) on high-priority streams; one stream where the
    # target is sharded (NCCL collectives of one communicator must not run from two streams at once).
    streams = LaneStreams(model_device, separate=not isinstance(target_pool, ShardedKVPool))
    if cfg.local_prefill_max_tokens:  # short prompts prefilled where they decode (lanes/engine/split_prefill.py)
        if cfg.mode == "pd":  # here, on the low-priority prefill stream
            local = LocalPrefiller(PrefillLane(target_runner, draft_runner, lazy_draft=True), streams.prefill)
        else:  # the target's KV by a verify replica, the draft's here
            local = VerifyLanePrefiller(link, draft_runner, streams.prefill, placement, owner)
        prefiller = SplitPrefiller(local, prefiller, cfg.local_prefill_max_tokens)
    core = EngineCore(config, vocab.size, vocab.tokenizer, eos_token_ids(vocab.generation_config, vocab.tokenizer),
                      draft_runner, verifier, prefiller, streams, build_proposer(cfg, model_device))
    core.capture_graphs()
    core.measure_forward_costs()
    return core


def load_shards(cfg: AppConfig) -> tuple[EngineConfig, list, tuple[bool, ...]]:
    """What a worker rank of the engine (decode-lane) replica builds its shards from
    (`lanes.parallel.worker.Loader`): the engine's config and the models it shards, on the host (a draft that
    runs whole on rank 0 is not loaded)."""
    draft = _draft(cfg, "cpu") if cfg.shard_draft else None
    return (_engine_config(cfg, cfg.decode_lane, _decode_lane_name(cfg)),
            [_target(cfg, "cpu").model, draft.model if draft else None], (True, cfg.shard_draft))


def load_prefill_shards(cfg: AppConfig) -> tuple[EngineConfig, list, tuple[bool, ...]]:
    """The same for a worker rank of a prefill-lane replica: the target (its draft runs on rank 0)."""
    return _prefill_config(cfg), [_target(cfg, "cpu").model, None], (True, False)


def load_verify_shards(cfg: AppConfig) -> tuple[EngineConfig, list, tuple[bool, ...]]:
    """The same for a worker rank of a verify-lane replica: the target."""
    return _verify_config(cfg), [_target(cfg, "cpu").model], (True,)


def _prefill_config(cfg: AppConfig) -> EngineConfig:
    # Scratch slots: one per prompt of a prefill batch (the deployment batches at most 8, and only as
    # many as the scratch pools' blocks hold: PrefillServer); their blocks come from the lane's memory
    # profile, and hold at least one prompt of max_model_len.
    return replace(_engine_config(cfg, cfg.prefill_lane, "prefill lane"), max_num_seqs=PREFILL_BATCH_MAX,
                   kv_copied_out=True)


def build_prompt_prefiller(cfg: AppConfig, tp_address: str | None = None) -> PromptPrefiller:
    """The prefill lane's prefiller; `tp_address`: where the ranks of its sharded target meet (it is
    rank 0, and runs the draft whole)."""
    _lane_logs_to_replica_log()
    device = cfg.prefill_lane.bind_device()
    tp = _rank0(cfg, tp_address, device)
    target, draft = _target(cfg, "cpu" if tp else device), _draft(cfg, device)  # no draft with prompt lookup
    _check_pair(cfg, draft, target)
    runners = build_runners(_prefill_config(cfg), target.model, draft.model if draft is not None else None,
                            tp=tp, sharded=(True, False))
    for runner in runners:
        if runner is not None:
            runner.capture_graphs((), prefill=True)  # whole-prompt graphs, before the first prompt
    return PromptPrefiller(*runners, cfg.engine.idle_prefill_tokens, cfg.engine.enable_prefix_caching)


def _verify_config(cfg: AppConfig) -> EngineConfig:
    config = _engine_config(cfg, cfg.verify_lane, "verify lane")
    # Each verify replica may hold requests of every decode replica (slots are handed out by the verify
    # replica with the fewest calls in flight, not the fewest slots in use): size its pool for all of them.
    autoscaling = cfg.decode_lane.autoscaling_config or {}
    if cfg.slo is not None:  # the planner grows the lane up to slo.max_replicas: num_replicas is where it starts
        replicas = autoscaling.get("max_replicas", cfg.slo.max_replicas)
    else:
        replicas = cfg.decode_lane.num_replicas or autoscaling.get("max_replicas", 1)
    return replace(config, max_num_seqs=config.max_num_seqs * replicas)


def build_verify_lane(cfg: AppConfig, tp_address: str | None = None) -> VerifyLane:
    """The verify lane; `tp_address`: where the ranks of its sharded target meet (it is rank 0)."""
    _lane_logs_to_replica_log()
    device = cfg.verify_lane.bind_device()
    tp = _rank0(cfg, tp_address, device)
    config = _verify_config(cfg)
    [runner] = build_runners(config, _target(cfg, "cpu" if tp else device).model, tp=tp, sharded=(True,))
    # Before the first verify; whole-prompt graphs too where this lane prefills short prompts (pdv's split).
    runner.capture_graphs(range(1, config.num_speculative_tokens + 2), prefill=bool(cfg.local_prefill_max_tokens))
    return VerifyLane(runner)
