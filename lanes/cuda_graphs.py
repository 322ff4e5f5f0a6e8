"""CUDA graphs of the few-token forward (decode: Q = 1 or 2, verify: Q = L + 1), one per
(batch bucket, Q), captured on first use and replayed after.

A small draft model is launch-bound: eager HF runs ~10 ms per step at any batch size (see
benchmarks/results). A replayed graph launches the whole forward at once. Rows of a batch smaller
than its bucket read and write the pool's pad slot, whose block-table row points only at the pad
block. Shapes in a graph depend only on (bucket, Q): the pool-attention kernel reads lengths, and
every kernel reads the pool's block table, from device memory; the table is a static input of every
graph, updated in place (KVPool.sync_block_table) before a replay, never reallocated.
"""

from collections.abc import Callable

import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


class _Graph:
    def __init__(self, bucket: int, q_len: int, pad_slot: int, device, forward: Callable, mempool):
        self.input_ids = torch.zeros(bucket, q_len, dtype=torch.long, device=device)
        self.slot_ids = torch.full((bucket,), pad_slot, dtype=torch.long, device=device)
        self.kv_lens = torch.zeros(bucket, dtype=torch.int32, device=device)
        args = (self.slot_ids, self.kv_lens, self.input_ids)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: compiles Triton kernels, settles allocations
            for _ in range(2):
                forward(*args)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool):
            self.logits = forward(*args)  # [bucket, Q, V]


class GraphedForward:
    def __init__(self, forward: Callable, pad_slot: int, device, max_batch: int):
        self.forward = forward  # (slot_ids [B], kv_lens [B], input_ids [B, Q]) -> logits [B, Q, V]
        self.pad_slot = pad_slot
        self.device = device
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.mempool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def __call__(self, slot_ids: torch.Tensor, kv_lens: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, Q, V]: a view into the graph's output, valid until the next replay."""
        batch, q_len = input_ids.shape
        bucket = next(b for b in self.buckets if b >= batch)
        graph = self.graphs.get((bucket, q_len))
        if graph is None:
            graph = self.graphs[(bucket, q_len)] = _Graph(bucket, q_len, self.pad_slot, self.device, self.forward,
                                                          self.mempool)
        graph.input_ids[:batch].copy_(input_ids, non_blocking=True)
        graph.slot_ids[:batch].copy_(slot_ids, non_blocking=True)
        graph.kv_lens[:batch].copy_(kv_lens, non_blocking=True)  # any integer dtype; the buffer is int32
        if batch < bucket:
            graph.slot_ids[batch:].fill_(self.pad_slot)
            graph.kv_lens[batch:].zero_()
        graph.graph.replay()
        return graph.logits[:batch]
