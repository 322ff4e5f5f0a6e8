"""Tensor parallelism of a Llama-family model over the ranks of one torch.distributed group.

What each rank holds (Megatron-LM's split, as vLLM shards the same layers):
- q/k/v and gate/up are column-parallel: rank r keeps its share of the query heads, the key and
  value heads those query heads read (so GQA groups never straddle ranks), and of the MLP's rows;
- o_proj and down_proj are row-parallel: rank r keeps the matching input columns, and the partial
  outputs are summed by one all-reduce each (two a layer); their biases are added on rank 0 only,
  so the sum carries them once;
- the KV pool holds the rank's KV heads only; block tables are the same on every rank (rank 0's
  scheduler decides them and sends the rows it changed with each forward's inputs, lanes/parallel/step.py);
- embeddings, norms and the rotary table are replicated. The LM head runs on rank 0 only: only
  rank 0 samples, so a vocab-parallel head would have to gather [tokens, V] logits to it each step
  anyway; workers skip it (and drop its weight when it is not tied to the embeddings).

Only the fused Llama-family path (lanes/model/fused_decoder.py) is sharded, without sliding windows: every
other family or feature (Gemma and sliding windows too, which the fused path computes but which are
not tested sharded), and head or MLP sizes that do not divide by the group size, are refused by name
at config validation and at load (`check_shardable`, `shard_model`).
"""

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lanes.model.families import UnsupportedModelError
from lanes.model.fused_decoder import sliding_window, unsupported_config, unsupported_reason

TP_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # the fused families that shard


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group. Rank 0 runs the engine; the others are workers."""

    rank: int
    size: int
    device: torch.device  # where this rank's shard lives (cuda:k with NCCL, cpu with gloo)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # In place. Under CUDA-graph capture PyTorch's NCCL backend records it into the graph (the
        # decode/verify graphs of a sharded runner hold theirs); not yet run on GPUs here.
        dist.all_reduce(x)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, src=0)
        return x

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Every rank's `x` (equal shapes), concatenated in rank order along `dim` on rank 0; None elsewhere."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim) if parts is not None else None

    def scatter(self, x: torch.Tensor | None, dim: int, like: torch.Tensor) -> torch.Tensor:
        """Rank r's r-th of `size` equal parts of rank 0's `x` along `dim`; the other ranks pass None
        and `like`, an empty tensor of their part's shape, dtype and device, which receives it."""
        parts = [p.contiguous() for p in x.chunk(self.size, dim)] if self.rank == 0 else None
        out = parts[0].clone() if parts is not None else like
        dist.scatter(out, parts, src=0)
        return out

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` of all ranks (block counts: each rank sizes its pool from its own memory,
        and block tables name the same blocks everywhere)."""
        out = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MIN)
        return int(out.item())


def init_group(rank: int, size: int, init_method: str, device: str | torch.device,
               timeout_s: float = 600) -> TPGroup:
    """Join the group (gloo on the CPU, NCCL on CUDA) as the default process group of this process.
    `timeout_s`: how long a collective waits for a rank that does not come (a worker that died)."""
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # "cuda": the rank's own GPU, first in its visible list
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=size, timeout=timedelta(seconds=timeout_s))
    return TPGroup(rank, size, device)


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def check_shardable(config, size: int) -> None:
    """Refuse, from the config alone, a model that `size` ranks cannot run exactly."""
    if size == 1:
        return
    text = config.get_text_config()
    if (reason := _unshardable(config)) is not None:
        raise _unfused(text.model_type, reason, size)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    counts = {"num_attention_heads": text.num_attention_heads, "num_key_value_heads": kv_heads,
              "intermediate_size": text.intermediate_size}
    uneven = [f"{name}={n}" for name, n in counts.items() if n % size]
    if uneven:
        raise UnsupportedModelError(f"{text.model_type}: {', '.join(uneven)} not divisible by "
                                    f"tensor_parallel_size={size} (KV heads are not replicated across ranks)")


def shard_model(model: torch.nn.Module, tp: TPGroup) -> None:
    """Keep this rank's shard of every layer's projections, in place on the HF modules (so the fused
    decoder fuses the shards as it fuses whole weights). The model is a shard afterwards: its own
    forward no longer computes the model."""
    check_shardable(model.config, tp.size)
    if (reason := unsupported_reason(model)) is not None:
        raise _unfused(model.config.model_type, reason, tp.size)
    for layer in model.get_decoder().layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _keep_rows(linear, tp)
        for linear in (attn.o_proj, mlp.down_proj):
            _keep_columns(linear, tp)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if tp.rank > 0 and head.weight.data_ptr() != embed.weight.data_ptr():
        head.weight.data = head.weight.data[:0]  # workers never run the head (see the module docstring)


def _unshardable(config) -> str | None:
    """What of a config the sharded fused layers do not compute (None: nothing)."""
    text = config.get_text_config()
    if text.model_type not in TP_TYPES:
        return f"model_type={text.model_type!r}"
    if window := sliding_window(text):
        return f"sliding_window={window}"
    return unsupported_config(config)


def _unfused(model_type: str, reason: str, size: int) -> UnsupportedModelError:
    families = ", ".join(TP_TYPES)
    return UnsupportedModelError(
        f"{model_type}: tensor_parallel_size={size} shards the fused Llama-family layers only ({families} without "
        f"sliding windows), which do not compute {reason}; serve it with tensor_parallel_size=1")


def _keep_rows(linear: torch.nn.Linear, tp: TPGroup) -> None:
    rows = linear.weight.shape[0] // tp.size
    part = slice(tp.rank * rows, (tp.rank + 1) * rows)
    linear.weight.data = linear.weight.data[part].contiguous()
    if linear.bias is not None:
        linear.bias.data = linear.bias.data[part].contiguous()


def _keep_columns(linear: torch.nn.Linear, tp: TPGroup) -> None:
    columns = linear.weight.shape[1] // tp.size
    linear.weight.data = linear.weight.data[:, tp.rank * columns:(tp.rank + 1) * columns].contiguous()
    if linear.bias is not None and tp.rank > 0:
        linear.bias = None  # added once, by rank 0, before the sum


def row_parallel_linear(tp: TPGroup):
    """F.linear over a row-parallel shard, summed over the ranks: the drop-in for F.linear at o_proj and
    down_proj (the fused decoder calls whichever it was given, so TP = 1 runs F.linear itself)."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return tp.all_reduce(F.linear(x, weight, bias))

    return linear
