"""What rank 0 (the engine or lane) tells the workers of a tensor-parallel group to do, in order.

Each forward of a sharded runner travels as two broadcasts, as vLLM's executor sends a step's inputs
to its workers: a fixed header [HEADER] int64 (what follows and its sizes), then every tensor of the
forward packed into one int64 vector (slot ids, starts, token ids, the kept query index, and the
block-table rows rank 0 changed since its previous forward). Rank 0 sends from the device tensors it
already has, so sending reads nothing back to the host; the workers read the header to size the rest.

A KV hand-over between lanes travels the same way: a header and the blocks it reads or writes, then
every rank's KV heads gathered to rank 0 (READ_KV) or scattered from it (WRITE_KV), lanes/parallel/kv_handover.py.
Both go through the one ordered channel, so a worker meets them between the same forwards rank 0 ran.
"""

from dataclasses import dataclass

import torch

from lanes.device.batching import to_device
from lanes.model.runner import Rows
from lanes.parallel.tensor_parallel import TPGroup

STOP, FORWARD, READ_KV, WRITE_KV = 0, 1, 2, 3
# op, model index, batch, q_len, max_start, has keep, prefill, table rows, table row width
HEADER = 9


@dataclass
class ForwardStep:
    """What a worker needs to run rank 0's forward on its own shard."""

    model_index: int  # which of the group's sharded runners (0: the target, 1: the draft)
    rows: Rows
    input_ids: torch.Tensor  # [B, Q]
    keep: torch.Tensor | None  # [B]
    prefill: bool
    table_rows: torch.Tensor | None  # [n, 1 + blocks_per_slot]: rows to copy into the pool's device table


def send_forward(tp: TPGroup, model_index: int, rows: Rows, input_ids: torch.Tensor, keep: torch.Tensor | None,
                 prefill: bool, table_rows: torch.Tensor | None) -> None:
    batch, q_len = input_ids.shape
    n_rows, width = (0, 0) if table_rows is None else table_rows.shape
    tp.broadcast(to_device([FORWARD, model_index, batch, q_len, rows.max_start, keep is not None, prefill, n_rows,
                            width], torch.long, tp.device))
    parts = [rows.slot_ids, rows.starts, input_ids.reshape(-1)]
    parts += [keep] if keep is not None else []
    parts += [table_rows.reshape(-1)] if table_rows is not None else []
    tp.broadcast(torch.cat([p.to(device=tp.device, dtype=torch.long) for p in parts]))


@dataclass
class KVStep:
    """A hand-over of one slot's KV: every rank reads (READ_KV) or writes (WRITE_KV) its own heads of
    `length` tokens in `blocks` of the runner `model_index` names."""

    op: int
    model_index: int
    blocks: list[int]
    length: int


def send_stop(tp: TPGroup) -> None:
    tp.broadcast(to_device([STOP] + [0] * (HEADER - 1), torch.long, tp.device))


def send_kv_step(tp: TPGroup, step: KVStep) -> None:
    tp.broadcast(to_device([step.op, step.model_index, len(step.blocks), step.length] + [0] * (HEADER - 4),
                           torch.long, tp.device))
    tp.broadcast(to_device(step.blocks, torch.long, tp.device))


def receive_step(tp: TPGroup) -> ForwardStep | KVStep | None:
    """The next thing rank 0 does, or None when it stops the workers."""
    header = tp.broadcast(torch.empty(HEADER, dtype=torch.long, device=tp.device)).tolist()
    op, model_index, batch, q_len, max_start, has_keep, prefill, n_rows, width = header
    if op == STOP:
        return None
    if op in (READ_KV, WRITE_KV):  # batch: the number of blocks, q_len: the tokens in them
        blocks = tp.broadcast(torch.empty(batch, dtype=torch.long, device=tp.device)).tolist()
        return KVStep(op, model_index, blocks, q_len)
    sizes = [batch, batch, batch * q_len, batch if has_keep else 0, n_rows * width]
    packed = tp.broadcast(torch.empty(sum(sizes), dtype=torch.long, device=tp.device))
    slot_ids, starts, ids, keep, table = packed.split(sizes)
    return ForwardStep(model_index, Rows(slot_ids, starts, max_start), ids.view(batch, q_len),
                       keep if has_keep else None, bool(prefill), table.view(n_rows, width) if n_rows else None)
