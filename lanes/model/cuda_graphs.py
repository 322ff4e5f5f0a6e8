"""CUDA graphs of the engine's forwards, one per shape bucket, replayed after their capture. Lanes
capture them before serving (ModelRunner.capture_graphs); a bucket missed there is captured on first use.

- `GraphedForward`: the few-token forward (decode: Q = 1 or 2, verify: Q = L + 1), one graph per
  (batch bucket, Q).
- `GraphedPrefill`: whole-prompt prefill (every row from position 0), one graph per (batch bucket,
  width bucket), the logits of each row's last prompt token only.

Why both: a forward run eagerly costs its kernel launches on the host. A small draft model is
launch-bound (eager HF runs ~10 ms per step at any batch size, see benchmarks/results), and so is a
7B prompt prefill beside a decode step: on an H100 a step that launched a 128-token prefill took
25 ms against 11.7 ms without one, for about 4 ms of GPU work
(benchmarks/results/serving_overhead_h100_prefill_graphs). A replayed graph launches the whole forward at once.

Rows of a batch smaller than its bucket read and write the pool's pad slot, whose block-table row
points only at the pad block; a prompt shorter than its width bucket is padded at its end, and
causal attention keeps the padding out of every real position (its keys land past the row's
length, or in the pad block, where nothing reads them). Shapes in a graph depend only on its key:
kernels read lengths and the pool's block table from device memory, and the table is a static input
of every graph, updated in place (KVPool.sync_block_table) before a replay, never reallocated.

Off CUDA (tests) a "graph" runs its forward eagerly on the same padded static buffers, so the
bucketing and padding are tested where no GPU is.
"""

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
PREFILL_WIDTHS = (32, 64, 128, 256, 512)  # prompt-length buckets of graphed prefill
# Padded tokens (rows x width) of the largest prefill replayed as a graph: larger forwards are
# compute-bound, and their launch cost no longer matters.
PREFILL_GRAPH_TOKENS = 1024


class _Graph:
    def __init__(self, inputs: tuple[torch.Tensor, ...], forward: Callable, mempool, stream):
        """Captured on `stream`, its family's own capture stream. cuBLAS keys its workspace by
        stream, and a graph keeps the workspace it was captured with: graphs captured on one stream
        share it (pytorch/pytorch#193402). A prefill graph and a decode graph that shared it hung
        the GPU when replayed at once on their lanes' streams (H200, prompts of 512 tokens and
        more, whose GEMMs take workspace algorithms: benchmarks/results/engine_loads_h200/)."""
        self.inputs = inputs  # static buffers: filled before each replay
        self.forward = forward
        self.graph = None
        device = inputs[0].device
        if device.type != "cuda":
            return
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up: compiles Triton kernels, settles allocations
            for _ in range(2):
                forward(*inputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with _collector_paused(), torch.cuda.graph(self.graph, pool=mempool, stream=stream):
            self.output = forward(*inputs)

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            return self.forward(*self.inputs)
        self.graph.replay()
        return self.output


@contextmanager
def _collector_paused() -> Iterator[None]:
    """No garbage collection while a graph captures. Destroying a CUDA graph is not permitted during a
    capture and invalidates it, and an earlier runner's graphs in a reference cycle are destroyed by the
    collector whenever it runs. torch.cuda.graph no longer collects before it captures (only under
    torch.compiler.config.force_cudagraph_gc). On an H100 a capture failed so, after 21 such destructions."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _capture(inputs: tuple[torch.Tensor, ...], forward: Callable, mempool, stream, capture_ms: dict, key) -> _Graph:
    start_s = time.perf_counter()
    graph = _Graph(inputs, forward, mempool, stream)
    capture_ms[key] = (time.perf_counter() - start_s) * 1e3
    if graph.graph is not None:
        log.info("captured a CUDA graph for %s in %.0f ms", key, capture_ms[key])
    return graph


def _bucket(buckets: list[int] | tuple[int, ...], size: int) -> int | None:
    return next((b for b in buckets if b >= size), None)


def _mempool(device: torch.device):
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None


def _capture_stream(device: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.Stream(device) if device.type == "cuda" else None


class GraphedForward:
    def __init__(self, forward: Callable, pad_slot: int, device, max_batch: int):
        self.forward = forward  # (slot_ids [B], kv_lens [B], input_ids [B, Q]) -> logits [B, Q, V]
        self.pad_slot = pad_slot
        self.device = torch.device(device)
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.mempool = _mempool(self.device)
        self.capture_stream = _capture_stream(self.device)  # this family's own: see _Graph
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.capture_ms: dict[tuple[int, int], float] = {}  # what each first use cost (warm-up + capture)

    def __call__(self, slot_ids: torch.Tensor, kv_lens: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, Q, V]: a view into the graph's output, valid until the next replay."""
        batch, q_len = input_ids.shape
        bucket = _bucket(self.buckets, batch)
        graph = self.graphs.get((bucket, q_len))
        if graph is None:
            inputs = (torch.full((bucket,), self.pad_slot, dtype=torch.long, device=self.device),
                      torch.zeros(bucket, dtype=torch.int32, device=self.device),
                      torch.zeros(bucket, q_len, dtype=torch.long, device=self.device))
            graph = self.graphs[(bucket, q_len)] = _capture(inputs, self.forward, self.mempool, self.capture_stream,
                                                             self.capture_ms, (bucket, q_len))
        slots, lens, ids = graph.inputs
        ids[:batch].copy_(input_ids, non_blocking=True)
        slots[:batch].copy_(slot_ids, non_blocking=True)
        lens[:batch].copy_(kv_lens, non_blocking=True)  # any integer dtype; the buffer is int32
        if batch < bucket:
            slots[batch:].fill_(self.pad_slot)
            lens[batch:].zero_()
        return graph.replay()[:batch]


class GraphedPrefill:
    """Whole prompts (every row from position 0) in a graph per (batch bucket, width bucket)."""

    def __init__(self, forward: Callable, pad_slot: int, device, max_batch: int, max_width: int):
        self.forward = forward  # (slot_ids [B], kv_lens [B] zeros, input_ids [B, W], keep [B]) -> logits [B, V]
        self.pad_slot = pad_slot
        self.device = torch.device(device)
        self.batches = [b for b in BATCH_BUCKETS if b <= max_batch]
        self.widths = [w for w in PREFILL_WIDTHS if w <= max_width]  # a row's positions must fit its slot
        # Its own memory pool: prefill replays on the prefill stream while decode graphs replay on
        # theirs, so the two must never share activation memory.
        self.mempool = _mempool(self.device)
        self.capture_stream = _capture_stream(self.device)  # this family's own: see _Graph
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.capture_ms: dict[tuple[int, int], float] = {}  # what each first use cost (warm-up + capture)

    def fits(self, batch: int, width: int) -> bool:
        bucket, padded = _bucket(self.batches, batch), _bucket(self.widths, width)
        return bucket is not None and padded is not None and bucket * padded <= PREFILL_GRAPH_TOKENS

    def __call__(self, slot_ids: torch.Tensor, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of row b's position keep[b]; the caller checked `fits`. A view into the
        graph's output, valid until the next replay."""
        batch, width = input_ids.shape
        key = (_bucket(self.batches, batch), _bucket(self.widths, width))
        graph = self.graphs.get(key)
        if graph is None:
            bucket, padded = key
            inputs = (torch.full((bucket,), self.pad_slot, dtype=torch.long, device=self.device),
                      torch.zeros(bucket, dtype=torch.int32, device=self.device),
                      torch.zeros(bucket, padded, dtype=torch.long, device=self.device),
                      torch.zeros(bucket, dtype=torch.long, device=self.device))
            graph = self.graphs[key] = _capture(inputs, self.forward, self.mempool, self.capture_stream,
                                                self.capture_ms, key)
        slots, _, ids, rows_keep = graph.inputs
        # Past a row's width the buffer keeps earlier prompts' tokens: valid ids, behind the causal mask.
        ids[:batch, :width].copy_(input_ids, non_blocking=True)
        slots[:batch].copy_(slot_ids, non_blocking=True)
        rows_keep[:batch].copy_(keep, non_blocking=True)
        slots[batch:].fill_(self.pad_slot)
        return graph.replay()[:batch]
