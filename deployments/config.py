"""The app config users write (YAML `args:` of `serve run`), validated once by pydantic.

    mode: pdv
    model_name: vpd-python
    target: {path: models/vpd-target, dtype: float32}   # tensor_parallel_size: N shards it (unified, spec, nospec)
    draft:  {path: models/vpd-draft,  dtype: float32}   # or {method: ngram, prompt_lookup_max: 5}
    engine: {max_model_len: 1024, max_num_seqs: 16, num_speculative_tokens: 4}
    prefill_lane: {num_gpus: 0.2}
    decode_lane:  {num_gpus: 0.2, num_replicas: 2}
    verify_lane:  {num_gpus: 0.5}                       # num_replicas / autoscaling_config as any lane
                                                        # resources: {verify_node: 1} pins a lane to such nodes
"""

from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, field_validator, model_validator

from controller.config import ControllerConfig, SloConfig
from deployments.placement.gpu_binding import (lane_device, log_mps_sm_share, mps_priority_env,
                                               mps_sm_percent_env, peer_access_env)
from lanes.engine.core import EngineConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TARGET = str(REPO_ROOT / "models" / "vpd-target")
DEFAULT_DRAFT = str(REPO_ROOT / "models" / "vpd-draft")

# Each step's tokens go out as the step ends (vLLM and SGLang stream every token too); a decode replica
# sends at most 400 messages a second over all its requests, since Serve's proxy, the ingress and the
# client read each one and nothing slows the replica when they fall behind: on an H100, streaming every
# step with no bound served 0.40x (64 in flight) and 0.30x (256) the tok/s of a 50 ms interval with this
# bound (benchmarks/results/stream_latency_h100/). The bound acts once n / 400 s passes the step (3
# requests at 6 ms); at one in flight the client's ITL p50 is the step (6.4 ms; 50 with a 50 ms interval).
# What a message costs each process, and when no bound pays (Serve's high-throughput settings, 4 ingress
# replicas): benchmarks/results/stream_hops_h100/.
STREAM_INTERVAL_MS = 0.0
MAX_STREAM_MESSAGES_PER_S = 400.0

Mode = Literal["pdv", "pd", "spec", "unified", "nospec"]
MODE_LANES: dict[str, tuple[str, ...]] = {
    "pdv": ("prefill_lane", "decode_lane", "verify_lane"),  # three lane deployments
    "pd": ("prefill_lane", "decode_lane"),  # prefill apart; the decode lane drafts and verifies
    "spec": ("decode_lane",),  # plain speculative decoding in one replica: whole prompts first
    "unified": ("decode_lane",),  # the co-located lane engine: decode first, chunked prefill
    "nospec": ("decode_lane",),  # target only
}
# The lanes' order on a GPU they share under MPS where their config leaves it unset (LaneConfig.mps_priority):
# prefill lowest, as the design has it; MPS has two levels, so decode and verify share the normal one.
DEFAULT_MPS_PRIORITY = {"prefill_lane": "below_normal"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    path: str = Field(description="HF hub id or local directory (AutoModelForCausalLM / AutoTokenizer). "
                      "A relative directory is taken from the repository root (replicas need not share the "
                      "driver's working directory).")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = Field(default="float32")
    tensor_parallel_size: int = Field(default=1, ge=1, description="Ranks the model's layers are sharded over "
                                      "(column/row-parallel attention and MLP, KV pools by KV head; "
                                      "lanes/parallel/tensor_parallel.py), one GPU each, in the placement group of the "
                                      "lane's replica. Llama-family models (llama, mistral, qwen2, qwen3) only; served "
                                      "in modes unified, spec and nospec. A draft's is 1 or the target's.")

    @field_validator("path")
    @classmethod
    def _anchor(cls, path: str) -> str:
        local = REPO_ROOT / path
        return str(local) if not Path(path).is_absolute() and local.exists() else path


# Every step searches each sequence once per n-gram length: the bound keeps that search cheap.
MAX_PROMPT_LOOKUP = 32


class NgramSpec(_Strict):
    """Drafting by prompt lookup (vLLM's `ngram` method): no draft model, no draft KV, no draft prefill.
    The longest suffix n-gram of a sequence's tokens that occurred earlier in them proposes the
    tokens that followed it; works best where outputs copy the prompt (code, editing, RAG)."""

    method: Literal["ngram"] = Field(description="Draft by n-gram prompt lookup.")
    prompt_lookup_min: int = Field(default=2, ge=1, le=MAX_PROMPT_LOOKUP,
                                   description="Shortest suffix n-gram that may match.")
    prompt_lookup_max: int = Field(default=5, ge=1, le=MAX_PROMPT_LOOKUP,
                                   description="Longest suffix n-gram tried (longer matches are preferred).")

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("draft.prompt_lookup_min must be <= draft.prompt_lookup_max")
        return self


class DraftModelSpec(ModelSpec):
    quantization: Literal["int8"] | None = Field(
        default=None, description="int8: the draft's linears and LM head read int8 weights with a scale per "
        "output channel (weight-only; lanes/model/int8_linear.py), half a bf16 draft's bytes a token. The "
        "output stays lossless (the target verifies every draft); the acceptance rate may change. Llama-family "
        "drafts in our fused layers, not sharded (tensor_parallel_size 1).")

    @model_validator(mode="after")
    def _quantized_whole(self) -> Self:
        if self.quantization is not None and self.tensor_parallel_size > 1:
            raise ValueError("draft.quantization needs draft.tensor_parallel_size 1: int8 weights are not sharded")
        return self

    allow_tokenizer_mismatch: bool = Field(
        default=False, description="Pair a draft whose tokenizer is not the target's (other merges, special "
        "tokens or normalizer) as long as every token id names the same token string in both; off, any "
        "difference is refused at load.")


def _draft_kind(value) -> str:
    # A `method` key means a draft-free method (its Literal names the allowed ones); else a model.
    has_method = "method" in value if isinstance(value, dict) else isinstance(value, NgramSpec)
    return "ngram" if has_method else "model"


DraftSpec = Annotated[Annotated[DraftModelSpec, Tag("model")] | Annotated[NgramSpec, Tag("ngram")],
                      Discriminator(_draft_kind)]


# Ray's own resource names, which a lane asks for through num_cpus / num_gpus (and Ray itself accounts).
RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class LaneConfig(_Strict):
    """Placement and scaling of one lane's deployment."""

    num_replicas: int | None = Field(default=1, ge=1, description="Fixed replica count (None with autoscaling).")
    num_gpus: float = Field(default=0, ge=0, description="GPU share per replica: a fraction shares one GPU, "
                            "1 or more gives whole GPUs. 0 runs the lane on the CPU.")
    num_cpus: float = Field(default=0.25, ge=0, description="CPU share per replica (Ray scheduling).")
    resources: dict[str, float] = Field(default_factory=dict, description="Ray custom resources each replica "
                                        "asks for (Serve's ray_actor_options.resources), which pin the lane to the "
                                        "nodes that offer them: {verify_node: 1} places it only on nodes started "
                                        "with that resource (`ray start --resources`, or a node type's `resources` "
                                        "in cluster.yaml). Names of Ray's own (CPU, GPU, memory) are refused: "
                                        "num_cpus and num_gpus say those.")
    max_ongoing_requests: int = Field(default=256, ge=1, description="Concurrent calls a replica accepts.")
    autoscaling_config: dict | None = Field(default=None, description="Ray Serve autoscaling_config; "
                                            "replaces num_replicas.")
    health_check_period_s: float = Field(default=10.0, gt=0, description="How often Serve runs a replica's "
                                         "health check (a dead or wedged engine fails it, and Serve replaces "
                                         "the replica).")
    mps_priority: Literal["normal", "below_normal"] | None = Field(
        default=None, description="Where lanes share a GPU as clients of NVIDIA MPS, the priority of this lane's "
        "kernels against the others' (CUDA_MPS_CLIENT_PRIORITY). Unset: below_normal for the prefill lane, "
        "normal for the others, as unified orders its streams. No effect without MPS.")
    mps_sm_percent: int | None = Field(
        default=None, ge=1, le=100, description="Where lanes share a GPU as clients of NVIDIA MPS, the percentage "
        "of the GPU's SMs this lane's kernels may occupy at once (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so that the "
        "others always find SMs free. Unset: no cap. No effect without MPS.")

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in RAY_BUILTIN_RESOURCES:
                raise ValueError(f"resources: {name!r} is Ray's own; set num_cpus / num_gpus instead")
            if amount <= 0:
                raise ValueError(f"resources: {name} must be > 0, not {amount:g}")
        return resources

    def bind_device(self) -> str:
        """Inside this lane's replica, before CUDA starts: the device to run on (and which GPUs it sees)."""
        device = lane_device(self.num_gpus)
        if device == "cuda":
            log_mps_sm_share()
        return device

    def deployment_options(self, peer_access: bool = False, tensor_parallel_size: int = 1,
                           default_mps_priority: str = "normal") -> dict:
        """Serve options of the lane's deployment. With `tensor_parallel_size` N > 1 each replica owns a
        placement group of N bundles on one node: its own (bundle 0) and one per worker rank, each
        with the replica's GPUs and CPUs (deployments/replicas/tp_workers.py places the workers in them).
        `default_mps_priority`: the lane's MPS priority where `mps_priority` is unset."""
        actor = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            actor["resources"] = dict(self.resources)
        priority = self.mps_priority or default_mps_priority
        if env_vars := {**peer_access_env(self.num_gpus, peer_access), **mps_priority_env(priority, self.num_gpus),
                        **mps_sm_percent_env(self.mps_sm_percent, self.num_gpus)}:
            actor["runtime_env"] = {"env_vars": env_vars}  # Ray merges these with the app's own env_vars
        opts = {"max_ongoing_requests": self.max_ongoing_requests, "ray_actor_options": actor,
                "health_check_period_s": self.health_check_period_s}
        if tensor_parallel_size > 1:
            opts["placement_group_bundles"] = [self.bundle] * tensor_parallel_size
            opts["placement_group_strategy"] = "STRICT_PACK"  # NCCL within one node
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = self.autoscaling_config
        else:
            opts["num_replicas"] = self.num_replicas
        return opts

    @property
    def bundle(self) -> dict[str, float]:
        """One rank's resources in a placement group."""
        gpus = {"GPU": self.num_gpus} if self.num_gpus > 0 else {}
        return {"CPU": self.num_cpus, **gpus, **self.resources}


class EngineArgs(_Strict):
    max_model_len: int | None = Field(default=None, ge=2, description="Prompt + output tokens per request. "
                                      "None: the target's own context (its max_position_embeddings), as vLLM "
                                      "does, or in unified, spec and nospec the longest whose one sequence fits "
                                      "the GPU memory (logged); KV memory is allocated in blocks as sequences "
                                      "grow, so a long context reserves nothing.")
    max_num_seqs: int = Field(default=16, ge=1, description="Requests a replica runs at once (a cap, not a "
                              "memory reservation: KV memory is allocated in blocks as sequences grow).")
    num_speculative_tokens: int = Field(default=4, ge=0, description="Default draft length L.")
    max_draft_len: int = Field(default=8, ge=0, le=16, description="Bound on any request's L.")
    prefill_chunk_tokens: int = Field(default=512, ge=1, description="Prefill tokens per step while decoding.")
    idle_prefill_tokens: int = Field(default=1024, ge=1, description="Prefill tokens per step when idle.")
    block_size: int = Field(default=16, ge=1, le=256, description="Tokens per KV-cache block.")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="Share of the GPU's memory a "
                                          "replica's models and KV pools may use (times the lane's num_gpus "
                                          "when it is a fraction); the pools get what the models leave. "
                                          "Ignored on the CPU.")
    num_kv_blocks: int | None = Field(default=None, ge=1, description="KV blocks per model pool, overriding "
                                      "gpu_memory_utilization. None: from free GPU memory on CUDA, else "
                                      "max_num_seqs sequences of max_model_len.")
    enable_prefix_caching: bool = Field(default=True, description="Reuse the KV of full prompt blocks that "
                                        "earlier requests computed (both models' pools).")
    cuda_graphs: bool | None = Field(default=None, description="Replay decode, verify and whole-prompt "
                                     "prefill forwards as CUDA graphs, captured at replica start. None: on "
                                     "CUDA. false: eager forwards and no capture (vLLM's enforce_eager).")
    async_scheduling: bool = Field(default=True, description="Launch each decode step (its drafts, then its "
                                   "verify) before the step it follows is read, its inputs taken on the device, "
                                   "so that the host's work between steps overlaps the GPU's (vLLM's async "
                                   "scheduling). It applies while no running request uses penalties, a grammar "
                                   "or prompt lookup, none waits to be admitted, and the verify lane is local "
                                   "(unified, spec, nospec, pd). false: every step's tokens are read before the "
                                   "next step launches.")
    max_migrations: int = Field(default=3, ge=0, description="pdv: times a request is recomputed on another "
                                "verify replica when the one holding its KV is scaled down or dies (its "
                                "output goes on where it stopped); once more, it fails. 0: it fails at once.")
    recover_within_s: float = Field(default=6.0, gt=0, description="pdv: seconds a request whose verify "
                                    "replica died may wait for a replica to take it back (recomputed there); "
                                    "then it ends with an error. A lane of one replica is replaced only after "
                                    "Serve's health check and the replica's start: tens of seconds. 6 s keeps "
                                    "every stream's end within 10 s of a loss on a busy host (at 8 s, 10.4 s on "
                                    "two cores).")

    _max_model_len_unset: bool = PrivateAttr(default=False)  # set by AppConfig when it resolves max_model_len

    def engine_config(self, mode: str) -> EngineConfig:
        assert self.max_model_len is not None, "AppConfig resolves max_model_len from the target"
        values = self.model_dump()
        if mode == "nospec":
            values["num_speculative_tokens"] = 0
        # Left unset, max_model_len is the target's context; a co-located engine whose memory cannot hold
        # one sequence of it takes the longest that fits instead, as vLLM's auto length does
        # (lanes/engine/core.py build_runners). Lanes of pd and pdv must agree on it: they refuse.
        values["fit_max_model_len"] = self._max_model_len_unset and mode in ("unified", "spec", "nospec")
        if mode == "spec":
            # Plain speculative decoding: no chunked prefill (no step both prefills and decodes) and
            # waiting prompts go first, as an engine without lane priorities does; prefill runs in
            # forwards of idle_prefill_tokens (one forward over a burst of prompts held activations of
            # GBs and ran out of GPU memory), and while requests decode at most one such forward runs
            # between two decode steps (issue 28: prefilling a whole burst first stalled decoding for
            # seconds). EngineConfig.prefill_first.
            values["prefill_first"] = True
        return EngineConfig(**values)


class AppConfig(_Strict):
    """Everything `build_app` needs. Unknown keys are errors, so typos fail at deploy time."""

    mode: Mode = "unified"
    model_name: str = Field(default="vpd-python", description="The id clients pass as `model`.")
    target: ModelSpec = Field(default_factory=lambda: ModelSpec(path=DEFAULT_TARGET))
    draft: DraftSpec | None = Field(default_factory=lambda: DraftModelSpec(path=DEFAULT_DRAFT), description=
                                    "The draft model, or {method: ngram, ...} to draft by prompt lookup.")
    engine: EngineArgs = Field(default_factory=EngineArgs)
    ingress: LaneConfig = Field(default_factory=lambda: LaneConfig(num_cpus=0.1))
    prefill_lane: LaneConfig = Field(default_factory=LaneConfig)
    decode_lane: LaneConfig = Field(default_factory=LaneConfig)
    verify_lane: LaneConfig = Field(default_factory=LaneConfig)
    controller: ControllerConfig = Field(default_factory=lambda: ControllerConfig(enabled=False))
    slo: SloConfig | None = Field(default=None, description="TTFT and TPOT targets. Set, every lane autoscales "
                                  "under Serve with the replica planner as its policy (controller/planner.py; "
                                  "docs/planner.md): a lane's num_replicas is the count it starts at, its "
                                  "autoscaling_config (if any) overrides the planner's bounds and delays, and a "
                                  "`policy` in it replaces the planner for that lane.")
    max_queued_requests: int = Field(default=256, ge=1, description="Requests in flight at the ingress "
                                     "beyond which new ones get 429 with Retry-After.")
    stream_interval_ms: float = Field(default=STREAM_INTERVAL_MS, ge=0, le=1000, description="Least time "
                                      "between two streamed messages of one request after its first (which "
                                      "is never held): a message carries every token made since the previous "
                                      "one. 0 (the default): each engine step's tokens as the step ends, "
                                      "unless max_stream_messages_per_s asks for longer.")
    local_prefill_max_tokens: int | None = Field(default=None, ge=0, description="Prompts of at most this "
                                                 "many tokens are prefilled where they decode; longer ones go to the "
                                                 "prefill lane (conditional disaggregation, as NVIDIA Dynamo's "
                                                 "max_local_prefill_length; lanes/engine/split_prefill.py). pd: by "
                                                 "the decode lane itself, in chunks inside its steps as unified "
                                                 "prefills. pdv: the target's KV by a verify replica, into its own "
                                                 "pool, on a stream below its verify forwards', and the draft's by "
                                                 "the decode lane (deployments/channels/verify_prefill.py); at most "
                                                 "engine.idle_prefill_tokens, and not with a sharded target. None: "
                                                 "pd: engine.prefill_chunk_tokens, a prompt of at most one chunk; "
                                                 "pdv: 0. 0: every prompt goes to the prefill lane.")
    engine_process: bool = Field(default=True, description="Step the engine in a process of its own (as "
                                 "vLLM V1 does) rather than on a thread of the replica: the step loop then "
                                 "shares no GIL with the replica's event loop and Ray's threads. In pd and "
                                 "pdv the decode replica relays its engine's calls to the other lanes.")
    verify_channel: bool | None = Field(default=None, description="pdv with engine_process: the engine sends "
                                        "its verify batches straight to the verify replicas over a connection "
                                        "each opens (deployments/channels/verify_channel.py) rather than through its "
                                        "replica and Serve. None: on, unless the verify lane autoscales "
                                        "(Serve's autoscaler counts only the calls Serve routes).")
    shared_drafts: bool | None = Field(default=None, description="pdv over verify channels: each batch's "
                                       "draft tokens go to a verify replica on the same device through a ring of "
                                       "device buffers it mapped once (CUDA IPC, an interprocess event after each "
                                       "copy) rather than through the host, so that the engine sends a batch as "
                                       "soon as its draft kernels are queued (lanes/device/shared_drafts.py). "
                                       "Batches with sampled drafts' probabilities or a grammar go through the "
                                       "host. None: on where the decode lane has a GPU; on the CPU the ring is "
                                       "shared memory.")
    stream_channel: Literal["request", "step"] = Field(default="request", description="How a decode replica "
                                                       "streams to the ingress. request: each request's chunks "
                                                       "as messages of its own Serve call. step: one message per "
                                                       "engine step per ingress replica, carrying every request's "
                                                       "chunks (deployments/channels/step_channel.py). The "
                                                       "ingress still sends each request's chunks to Serve's "
                                                       "proxy as HTTP messages, so max_stream_messages_per_s "
                                                       "still bounds them.")
    max_stream_messages_per_s: float | None = Field(default=MAX_STREAM_MESSAGES_PER_S, gt=0, description=
                                                    "Bound on the streamed messages a decode replica sends per "
                                                    "second over all its requests: with n requests in flight "
                                                    "each one's interval is at least n / this, and its message "
                                                    "carries the steps made meanwhile (vpd_stream_coalesced_outputs "
                                                    "counts them). Every message costs Serve's proxy, the ingress "
                                                    "and the client a read, and Serve gives the replica no sign "
                                                    "that they fall behind. With engine_process: false a message "
                                                    "also takes GIL time that the engine's step loop waits for. "
                                                    "None: no bound.")
    api_key: str | None = Field(default=None, min_length=1, repr=False, description="When set (or when the "
                                "ingress replica's environment has VPD_API_KEY; this field wins), every route but "
                                "/health requires `Authorization: Bearer <key>`, as vLLM's --api-key does.")
    request_timeout_s: float = Field(default=600, gt=0, description="A request still running after this "
                                     "is aborted in every lane.")
    kv_peer_access: bool = Field(default=True, description="Lane replicas see every GPU of their node, so "
                                 "a prompt's KV crosses GPUs by a peer copy (NVLink or PCIe) into its owner's "
                                 "pool. False: it goes through host memory and Ray's object store.")
    require_gpus_present: bool = Field(default=True, description="Fail at build time when a lane asks for "
                                       "GPUs, or custom `resources`, that no node of the cluster has (set false "
                                       "on an autoscaling cluster whose nodes of that kind start on demand).")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.mode != "nospec" and self.draft is None:
            raise ValueError(f"mode {self.mode!r} needs a draft: a model, or {{method: ngram}}")
        if self.engine.num_speculative_tokens > self.engine.max_draft_len:
            raise ValueError("engine.num_speculative_tokens must be <= engine.max_draft_len")
        if self.controller.enabled and self.controller.max_draft_len > self.engine.max_draft_len:
            raise ValueError("controller.max_draft_len must be <= engine.max_draft_len")
        if self.local_prefill_max_tokens is None:
            self.local_prefill_max_tokens = self.engine.prefill_chunk_tokens if self.mode == "pd" else 0
        elif self.local_prefill_max_tokens > 0:
            self._check_local_prefill()
        if self.engine.max_model_len is None:
            self.engine.max_model_len = model_context(self.target.path)
            self.engine._max_model_len_unset = True
        self._check_tensor_parallel()
        self._check_slo()
        return self

    def _check_slo(self) -> None:
        if self.slo is None:
            return
        for lane in self.lanes:
            config = getattr(self, lane)
            top = (config.autoscaling_config or {}).get("max_replicas", self.slo.max_replicas)
            if config.num_replicas is not None and config.num_replicas > top:
                raise ValueError(f"{lane}.num_replicas ({config.num_replicas}), where the lane starts under slo, "
                                 f"exceeds its max_replicas ({top})")

    def _check_local_prefill(self) -> None:
        if self.mode not in ("pd", "pdv"):
            raise ValueError(f"local_prefill_max_tokens applies to modes 'pd' and 'pdv' (in {self.mode!r} it must "
                             "be 0 or unset): the other modes have no prefill lane")
        if self.mode != "pdv":
            return
        if self.local_prefill_max_tokens > self.engine.idle_prefill_tokens:
            # The verify lane's memory profile measured a prefill forward of idle_prefill_tokens.
            raise ValueError(f"in 'pdv' local_prefill_max_tokens ({self.local_prefill_max_tokens}) must be at most "
                             f"engine.idle_prefill_tokens ({self.engine.idle_prefill_tokens})")
        if self.tensor_parallel_size > 1:
            raise ValueError("in 'pdv' with a sharded target, local_prefill_max_tokens must be 0: a verify replica "
                             "prefills short prompts on one rank only")

    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        draft = self.draft_model
        if draft is not None and draft.tensor_parallel_size not in (1, size):
            raise ValueError(f"draft.tensor_parallel_size must be 1 or the target's ({size}): a draft is "
                             "sharded over the target's ranks or runs whole on rank 0")
        if size == 1:
            return
        if self.mode in ("pd", "pdv") and draft is not None and draft.tensor_parallel_size > 1:
            raise ValueError(f"in {self.mode!r} draft.tensor_parallel_size must be 1: the draft runs whole in the "
                             "decode lane and on rank 0 of the prefill lane")
        for lane in self.target_lanes:
            gpus = getattr(self, lane).num_gpus
            if gpus not in (0, 1):
                raise ValueError(f"target.tensor_parallel_size={size} takes one whole GPU per rank: {lane}.num_gpus "
                                 f"must be 1 (or 0 on the CPU, over gloo), not {gpus:g}")

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks of the group of each replica that holds the target: the target's size (a draft's is 1
        or the same)."""
        return self.target.tensor_parallel_size

    @property
    def target_lanes(self) -> tuple[str, ...]:
        """The lanes whose replicas hold the target (sharded over `tensor_parallel_size` ranks each)."""
        return {"pd": ("prefill_lane", "decode_lane"), "pdv": ("prefill_lane", "verify_lane")}.get(
            self.mode, ("decode_lane",))

    def lane_ranks(self, lane: str) -> int:
        """Ranks (one bundle of the lane's GPUs and CPUs each) of one replica of `lane`."""
        return self.tensor_parallel_size if lane in self.target_lanes else 1

    @property
    def shard_draft(self) -> bool:
        """Whether the draft model is sharded over the target's ranks (else it runs whole on rank 0)."""
        draft = self.draft_model
        return draft is not None and draft.tensor_parallel_size > 1

    @property
    def lanes(self) -> tuple[str, ...]:
        return MODE_LANES[self.mode]

    @property
    def uses_verify_channel(self) -> bool:
        """Whether pdv's engine sends its verify batches over channels (`verify_channel`)."""
        if self.verify_channel is not None:
            return self.verify_channel
        return self.verify_lane.autoscaling_config is None and self.slo is None

    @property
    def uses_shared_drafts(self) -> bool:
        """Whether pdv's engine offers its verify replicas rings for its drafts (`shared_drafts`)."""
        if self.shared_drafts is not None:
            return self.shared_drafts
        return self.decode_lane.num_gpus > 0

    @property
    def draft_model(self) -> DraftModelSpec | None:
        """The draft model that this mode loads (None: no speculation, or prompt lookup)."""
        return self.draft if isinstance(self.draft, ModelSpec) and self.mode != "nospec" else None

    @property
    def ngram(self) -> NgramSpec | None:
        """Prompt-lookup drafting, where this mode drafts by it."""
        return self.draft if isinstance(self.draft, NgramSpec) and self.mode != "nospec" else None


def model_context(path: str) -> int:
    """A model's own context (max_position_embeddings of its text config), read from its config.json."""
    from transformers import AutoConfig  # only when a config leaves max_model_len unset

    try:
        context = AutoConfig.from_pretrained(path).get_text_config().max_position_embeddings
    except (OSError, ValueError) as exc:
        raise ValueError(f"engine.max_model_len is unset and the target's config could not be read "
                         f"({type(exc).__name__}: {exc}): set engine.max_model_len") from exc
    if not isinstance(context, int) or context < 2:
        raise ValueError(f"the target's config has no usable max_position_embeddings ({context!r}): "
                         "set engine.max_model_len")
    return context
