"""Ray metrics exported by every lane and by the ingress.

Each deployment builds one `LaneMetrics(lane, mode)` (prefill / decode / verify lane) or one
`IngressMetrics(mode)` and calls its methods; the metric objects themselves are created once per
process, so several lanes hosted in one process share them and differ only in their tags.

As exported (checked against Ray 2.60's `/metrics` endpoint): Ray prefixes every name with `ray_`,
counters gain `_total`, histograms export `_bucket` / `_sum` / `_count`, and every series carries
Ray's own labels (`Component`, `NodeAddress`, `SessionName`, `Version`, `WorkerId`), one series per
worker process, so queries aggregate with `sum by (...)`. Every metric here is tagged with `mode`
(nospec, spec, pd, pdv, unified) so one Prometheus can hold runs of several modes.

Spec-decode counters follow vLLM's definitions, so a dashboard built for one reads the other:

- `vpd_spec_decode_num_drafts`: draft proposals verified (one per sequence per verify step
  that carried at least one draft token).
- `vpd_spec_decode_num_draft_tokens`: draft tokens proposed in those drafts.
- `vpd_spec_decode_num_accepted_tokens`: draft tokens the target accepted.
- `vpd_spec_decode_num_accepted_tokens_per_pos{position="i"}`: drafts whose token at position i
  was accepted (acceptance is a prefix, so these sum to num_accepted_tokens).

PromQL over a window `$w` (as exported):

    acceptance rate =
        sum(rate(ray_vpd_spec_decode_num_accepted_tokens_total[$w]))
      / sum(rate(ray_vpd_spec_decode_num_draft_tokens_total[$w]))
    mean acceptance length (tokens per verify step, bonus token included) =
        1 + sum(rate(ray_vpd_spec_decode_num_accepted_tokens_total[$w]))
          / sum(rate(ray_vpd_spec_decode_num_drafts_total[$w]))
    acceptance at position i =
        sum(rate(ray_vpd_spec_decode_num_accepted_tokens_per_pos_total{position="i"}[$w]))
      / sum(rate(ray_vpd_spec_decode_num_drafts_total[$w]))

Prefix-cache counters follow vLLM's too (`prefix_cache_queries` / `prefix_cache_hits`), by lane
(the decode lane in unified, spec and nospec; the prefill lane in pd and pdv):

- `vpd_prefix_cache_queries`: prompt tokens looked up in the prefix cache.
- `vpd_prefix_cache_hits`: those of them whose KV was found (their prefill skipped).

    prefix-cache hit rate = sum(rate(ray_vpd_prefix_cache_hits_total[$w]))
                          / sum(rate(ray_vpd_prefix_cache_queries_total[$w]))
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from typing import Any

# Status the ingress reports for a request that streamed to its end; latency histograms observe
# only these, so a fast 4xx does not pull the latency percentiles down (failures show in
# vpd_requests by status instead).
COMPLETED = "completed"

STEP_TIME_MS_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]
BATCH_SIZE_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
# Draft lengths are small integers; half-integer bounds give each length its own bucket
# (Ray requires positive bounds, so 0 = "speculation off" lands in le=0.5).
DRAFT_LENGTH_BUCKETS = [k + 0.5 for k in range(16)]
TTFT_MS_BUCKETS = [10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000]
TPOT_MS_BUCKETS = [1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000]
E2E_MS_BUCKETS = [50, 100, 250, 500, 1000, 2500, 5000, 10000, 20000, 30000, 60000, 120000, 300000]
# A lane reads its GPU at most this often, from observe_step. Ray exports a gauge only while it is
# being set (a gauge left alone drops out of /metrics after about two report intervals, 10 s
# each by default), so this must stay well under the report interval.
GPU_SAMPLE_INTERVAL_S = 2.0


@dataclass(frozen=True)
class _Registry:
    """The Ray metric objects of this process (see module docstring for names and labels)."""

    requests: Any
    generated_tokens: Any
    num_drafts: Any
    num_draft_tokens: Any
    num_accepted_tokens: Any
    num_accepted_tokens_per_pos: Any
    queue_depth: Any
    batch_size: Any
    step_time_ms: Any
    draft_length: Any
    request_draft_length: Any
    ttft_ms: Any
    tpot_ms: Any
    e2e_latency_ms: Any
    prefix_cache_queries: Any
    prefix_cache_hits: Any
    kv_slots_used: Any
    kv_slots_total: Any
    kv_blocks_used: Any
    kv_blocks_total: Any
    gpu_utilization_ratio: Any
    gpu_memory_used_bytes: Any
    ignored_request_fields: Any
    oom_recoveries: Any
    stream_messages: Any
    stream_coalesced: Any
    prompts_prefilled: Any
    internal_errors: Any


@functools.cache
def _registry() -> _Registry:
    # Imported here so that reading GPU stats (read_gpu_stats) works where Ray is absent.
    from ray.util.metrics import Counter, Gauge, Histogram

    lane_tags = ("mode", "lane")
    return _Registry(
        requests=Counter("vpd_requests", "Requests finished at the ingress, by status.",
                         tag_keys=("mode", "status")),
        generated_tokens=Counter("vpd_generated_tokens", "Completion tokens sent to clients.",
                                 tag_keys=("mode",)),
        num_drafts=Counter("vpd_spec_decode_num_drafts", "Draft proposals verified.",
                           tag_keys=("mode",)),
        num_draft_tokens=Counter("vpd_spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                 tag_keys=("mode",)),
        num_accepted_tokens=Counter("vpd_spec_decode_num_accepted_tokens",
                                    "Draft tokens accepted by the target.", tag_keys=("mode",)),
        num_accepted_tokens_per_pos=Counter(
            "vpd_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted.", tag_keys=("mode", "position")),
        queue_depth=Gauge("vpd_lane_queue_depth", "Sequences waiting for this lane.",
                          tag_keys=lane_tags),
        batch_size=Histogram("vpd_lane_batch_size", "Sequences in one lane step.",
                             boundaries=BATCH_SIZE_BUCKETS, tag_keys=lane_tags),
        step_time_ms=Histogram("vpd_lane_step_time_ms", "Wall time of one lane step (ms).",
                               boundaries=STEP_TIME_MS_BUCKETS, tag_keys=lane_tags),
        draft_length=Gauge("vpd_draft_length", "Current default draft length L.",
                           tag_keys=lane_tags),
        request_draft_length=Histogram("vpd_request_draft_length",
                                       "Draft length used for a sequence in one step.",
                                       boundaries=DRAFT_LENGTH_BUCKETS, tag_keys=lane_tags),
        ttft_ms=Histogram("vpd_ttft_ms", "Time to first token of completed requests (ms).",
                          boundaries=TTFT_MS_BUCKETS, tag_keys=("mode",)),
        tpot_ms=Histogram("vpd_tpot_ms", "Time per output token after the first (ms).",
                          boundaries=TPOT_MS_BUCKETS, tag_keys=("mode",)),
        e2e_latency_ms=Histogram("vpd_e2e_latency_ms", "End-to-end latency (ms).",
                                 boundaries=E2E_MS_BUCKETS, tag_keys=("mode",)),
        prefix_cache_queries=Counter("vpd_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                     "(vLLM's prefix_cache_queries).", tag_keys=("mode", "lane")),
        prefix_cache_hits=Counter("vpd_prefix_cache_hits", "Prompt tokens found in the prefix cache, their "
                                  "prefill skipped (vLLM's prefix_cache_hits).", tag_keys=("mode", "lane")),
        kv_slots_used=Gauge("vpd_kv_slots_used", "KV cache slots in use.",
                            tag_keys=("mode", "lane", "model")),
        kv_slots_total=Gauge("vpd_kv_slots_total", "KV cache slots allocated.",
                             tag_keys=("mode", "lane", "model")),
        kv_blocks_used=Gauge("vpd_kv_blocks_used", "KV cache blocks held by requests (cached free ones not counted).",
                             tag_keys=("mode", "lane", "model")),
        kv_blocks_total=Gauge("vpd_kv_blocks_total", "KV cache blocks of the pool.",
                              tag_keys=("mode", "lane", "model")),
        gpu_utilization_ratio=Gauge("vpd_gpu_utilization_ratio",
                                    "GPU busy fraction over NVML's last sample period (0..1).",
                                    tag_keys=("mode", "lane", "gpu")),
        gpu_memory_used_bytes=Gauge("vpd_gpu_memory_used_bytes",
                                    "GPU memory in use on the device, all processes (bytes).",
                                    tag_keys=("mode", "lane", "gpu")),
        ignored_request_fields=Counter("vpd_ignored_request_fields", "Request fields this server does not know, "
                                       "accepted and ignored, by name.", tag_keys=("mode", "field")),
        oom_recoveries=Counter("vpd_oom_recoveries", "Forwards that ran out of device memory and whose requests "
                               "were recomputed or retried smaller (never sent to a client).", tag_keys=lane_tags),
        stream_messages=Counter("vpd_stream_messages", "Streamed messages a decode (or engine) replica sent "
                                "towards the ingress.", tag_keys=lane_tags),
        stream_coalesced=Counter("vpd_stream_coalesced_outputs", "Engine steps' outputs of a request that went "
                                 "out merged into another step's message: max_stream_messages_per_s or "
                                 "stream_interval_ms held it, or the replica's event loop had not taken the "
                                 "previous one (lane=ingress: an ingress replica under stream_channel: step "
                                 "fell behind its channel).", tag_keys=lane_tags),
        prompts_prefilled=Counter("vpd_prompts_prefilled", "Prompts prefilled where they decode (where=decode_lane: "
                                  "at most local_prefill_max_tokens; in pdv the target's KV by the verify lane) and "
                                  "by the prefill lane.",
                                  tag_keys=("mode", "lane", "where")),
        internal_errors=Counter("vpd_internal_errors", "Requests that failed inside the server, by kind; the "
                                "client got a fixed message, the log has the detail.", tag_keys=("mode", "kind")),
    )


@dataclass(frozen=True)
class GpuStats:
    gpu: str  # the device's UUID: indices restart at 0 in every process Ray gives one GPU
    utilization_ratio: float | None  # None where NVML (nvidia-ml-py) is not installed
    memory_used_bytes: int


def read_gpu_stats() -> GpuStats | None:
    """Utilisation and memory of this process's current CUDA device; None without a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", device)
    return GpuStats(gpu=str(uuid), utilization_ratio=_nvml_utilization_ratio(torch, device),
                    memory_used_bytes=total_bytes - free_bytes)


def _nvml_utilization_ratio(torch: Any, device: int) -> float | None:
    # torch maps the device through CUDA_VISIBLE_DEVICES (indices or UUIDs, as Ray sets it) to
    # NVML's numbering; it needs nvidia-ml-py, without which there is no utilisation to read.
    try:
        return torch.cuda.utilization(device) / 100.0
    except Exception:  # nvidia-ml-py missing, or NVML refusing (e.g. a sandboxed GPU): no reading
        return None


class LaneMetrics:
    """Metrics of one lane (prefill, decode = draft, verify = target) in one mode."""

    def __init__(self, lane: str, mode: str, sample_gpu: bool = True):
        self._metrics = _registry()
        self._mode = mode
        self._tags = {"mode": mode, "lane": lane}
        # False where the GPU belongs to another process (an engine process), which sends its readings
        # to export_gpu: reading here would open a CUDA context in this process for nothing.
        self._sample_gpu = sample_gpu
        self._gpu_sampled_at_s = -GPU_SAMPLE_INTERVAL_S

    def observe_step(self, step_time_ms: float, batch_size: int) -> None:
        """One lane step: its wall time and the number of sequences it carried. Every
        GPU_SAMPLE_INTERVAL_S it also exports the lane's GPU utilisation and memory."""
        self._metrics.step_time_ms.observe(step_time_ms, tags=self._tags)
        self._metrics.batch_size.observe(batch_size, tags=self._tags)
        now_s = time.monotonic()
        if self._sample_gpu and now_s - self._gpu_sampled_at_s >= GPU_SAMPLE_INTERVAL_S:
            self._gpu_sampled_at_s = now_s
            self.sample_gpu()

    def set_queue_depth(self, n: int) -> None:
        """Sequences waiting for this lane now."""
        self._metrics.queue_depth.set(n, tags=self._tags)

    def set_kv_slots(self, used: int, total: int, model: str) -> None:
        """KV cache slots in use and allocated for `model` (draft or target) in this lane."""
        tags = {**self._tags, "model": model}
        self._metrics.kv_slots_used.set(used, tags=tags)
        self._metrics.kv_slots_total.set(total, tags=tags)

    def set_kv_blocks(self, used: int, total: int, model: str) -> None:
        """KV cache blocks held by requests and in the pool of `model` (draft or target) in this lane."""
        tags = {**self._tags, "model": model}
        self._metrics.kv_blocks_used.set(used, tags=tags)
        self._metrics.kv_blocks_total.set(total, tags=tags)

    def record_prefix_cache(self, queries: int, hits: int) -> None:
        """Prompt tokens looked up in this lane's prefix cache since the last call, and of those found."""
        for counter, value in ((self._metrics.prefix_cache_queries, queries), (self._metrics.prefix_cache_hits, hits)):
            if value > 0:  # Ray counters refuse increments of 0
                counter.inc(value, tags=self._tags)

    def record_spec(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                    accepted_per_pos: list[int]) -> None:
        """Counts of one or more verify steps, with vLLM's definitions (module docstring)."""
        _check_spec_counts(num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_pos)
        mode_tags = {"mode": self._mode}
        # Ray counters refuse increments of 0, and an absent increment is the same count.
        for counter, value in ((self._metrics.num_drafts, num_drafts),
                               (self._metrics.num_draft_tokens, num_draft_tokens),
                               (self._metrics.num_accepted_tokens, num_accepted_tokens)):
            if value > 0:
                counter.inc(value, tags=mode_tags)
        for position, accepted in enumerate(accepted_per_pos):
            if accepted > 0:
                self._metrics.num_accepted_tokens_per_pos.inc(
                    accepted, tags={**mode_tags, "position": str(position)})

    def record_oom_recoveries(self, count: int) -> None:
        """Out-of-memory errors this lane recovered from since the last call."""
        if count > 0:  # Ray counters refuse increments of 0
            self._metrics.oom_recoveries.inc(count, tags=self._tags)

    def record_stream_messages(self, messages: int, coalesced: int) -> None:
        """Stream messages sent, and step outputs merged into another's message, since the last call."""
        if messages > 0:  # Ray counters refuse increments of 0
            self._metrics.stream_messages.inc(messages, tags=self._tags)
        if coalesced > 0:
            self._metrics.stream_coalesced.inc(coalesced, tags=self._tags)

    def record_prompts_prefilled(self, by_lane: dict[str, int]) -> None:
        """Prompts prefilled since the last call, by where: {"decode_lane": n, "prefill_lane": m} (pd's split)."""
        for where, count in by_lane.items():
            if count > 0:  # Ray counters refuse increments of 0
                self._metrics.prompts_prefilled.inc(count, tags={**self._tags, "where": where})

    def set_draft_length(self, default_len: int) -> None:
        """The draft length L the controller currently applies by default."""
        self._metrics.draft_length.set(default_len, tags=self._tags)

    def observe_request_draft_length(self, length: int) -> None:
        """The draft length one sequence used in one step (0 = not speculated)."""
        self._metrics.request_draft_length.observe(length, tags=self._tags)

    def sample_gpu(self) -> None:
        """Export the current device's utilisation and memory; does nothing without a GPU."""
        self.export_gpu(read_gpu_stats())

    def export_gpu(self, stats: GpuStats | None) -> None:
        """Export a GPU reading (read here, or in the engine process that owns the GPU)."""
        if stats is None:
            return
        tags = {**self._tags, "gpu": stats.gpu}
        self._metrics.gpu_memory_used_bytes.set(stats.memory_used_bytes, tags=tags)
        if stats.utilization_ratio is not None:
            self._metrics.gpu_utilization_ratio.set(stats.utilization_ratio, tags=tags)


def _check_spec_counts(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                       accepted_per_pos: list[int]) -> None:
    # A wrong count would silently skew every acceptance panel, so a caller's bug fails loudly.
    if min(num_drafts, num_draft_tokens, num_accepted_tokens, *accepted_per_pos, 0) < 0:
        raise ValueError("spec-decode counts must be non-negative")
    if num_accepted_tokens > num_draft_tokens or num_drafts > num_draft_tokens:
        raise ValueError(f"inconsistent spec-decode counts: drafts={num_drafts}, "
                         f"draft_tokens={num_draft_tokens}, accepted={num_accepted_tokens}")
    if sum(accepted_per_pos) != num_accepted_tokens:
        raise ValueError(f"accepted_per_pos {accepted_per_pos} does not sum to "
                         f"num_accepted_tokens={num_accepted_tokens}")


# Ignored field names come from clients: a label value only for names that look like a field, and for
# at most this many distinct names per replica, so that a client inventing names cannot grow the
# series without bound (or send a label Ray's exporter cannot encode). Others count as "(other)".
MAX_IGNORED_FIELD_LABELS = 100
_FIELD_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class IngressMetrics:
    """Request-level metrics recorded by the ingress for one mode."""

    def __init__(self, mode: str):
        self._metrics = _registry()
        self._tags = {"mode": mode}
        self._field_labels: set[str] = set()

    def observe_ignored_fields(self, names: list[str]) -> None:
        """Fields of one request that neither OpenAI's API nor vLLM's server defines (ignored)."""
        for name in names:
            self._metrics.ignored_request_fields.inc(1, tags={**self._tags, "field": self._field_label(name)})

    def _field_label(self, name: str) -> str:
        if name not in self._field_labels:
            if not _FIELD_NAME.fullmatch(name) or len(self._field_labels) >= MAX_IGNORED_FIELD_LABELS:
                return "(other)"
            self._field_labels.add(name)
        return name

    def observe_internal_error(self, kind: str) -> None:
        """A request that failed inside the server (`kind`: a fixed label, never client text)."""
        self._metrics.internal_errors.inc(1, tags={**self._tags, "kind": kind})

    def observe_stream_coalesced(self, outputs: int) -> None:
        """Step outputs merged into another's chunk here because this replica fell behind its channel
        (`stream_channel: step`)."""
        self._metrics.stream_coalesced.inc(outputs, tags={**self._tags, "lane": "ingress"})

    def observe_request(self, status: str, ttft_ms: float | None, tpot_ms: float | None,
                        e2e_ms: float, completion_tokens: int) -> None:
        """One finished request. Latencies are observed only for status "completed"."""
        self._metrics.requests.inc(1, tags={**self._tags, "status": status})
        if completion_tokens > 0:
            self._metrics.generated_tokens.inc(completion_tokens, tags=self._tags)
        if status != COMPLETED:
            return
        self._metrics.e2e_latency_ms.observe(e2e_ms, tags=self._tags)
        if ttft_ms is not None:
            self._metrics.ttft_ms.observe(ttft_ms, tags=self._tags)
        if tpot_ms is not None:
            self._metrics.tpot_ms.observe(tpot_ms, tags=self._tags)
