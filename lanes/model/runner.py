"""One batched forward of an HF causal LM over rows that each sit at their own length in the pool."""

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from lanes.device.batching import to_device
from lanes.kv.pool import KVPool
from lanes.model import int8_linear as int8
from lanes.model.attention import POOL_ATTENTION, PoolAttentionMeta
from lanes.model.cuda_graphs import GraphedForward, GraphedPrefill
from lanes.model.fused_decoder import FusedDecoder, supports
from lanes.model.pool_cache import PoolCache
from lanes.parallel.tensor_parallel import TPGroup, row_parallel_linear

log = logging.getLogger(__name__)

KV_BOUND_MULTIPLE = 64  # round the gathered length up so shapes repeat (fewer allocator / kernel variants)
GRAPH_MAX_Q = 16  # decode and verify steps (Q <= L + 2) replay graphs; longer inputs are prefill
# Eager chunk widths run once at start (ModelRunner.capture_graphs): each side of the attention
# kernel's row tiles (16, 32, 64, 128), multiples of 16 and not, which Triton compiles apart.
EAGER_CHUNK_WIDTHS = (15, 16, 24, 32, 48, 64, 100, 128)


@dataclass(frozen=True)
class Rows:
    """Where each row of a forward sits in the pool. Built once per lane step (`ModelRunner.rows`,
    or from a lane's own packed copy) and advanced on the device between the forwards of a draft."""

    slot_ids: torch.Tensor  # [B] int64 on the runner's device
    starts: torch.Tensor  # [B] integer, on the device: tokens already in each row's slot
    max_start: int  # host-side: the largest start (slot capacity check, keys the gather path reads)

    def advanced(self, tokens: int) -> "Rows":
        """The same rows after `tokens` more were written to each."""
        return Rows(self.slot_ids, self.starts + tokens, self.max_start + tokens)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool, attention_kernel: bool | None = None,
                 cuda_graphs: bool | None = None, fused_layers: bool | None = None, tp: TPGroup | None = None,
                 share_forward: Callable | None = None, int8_weights: bool = False):
        """`tp`: the group over which `model` (already a shard, lanes/parallel/tensor_parallel.py) and `pool` (this
        rank's KV heads) are split; `share_forward(rows, input_ids, keep, prefill, table_rows)`, on rank
        0 of it, sends each forward's inputs to the workers before running it (lanes/parallel/step.py).
        `int8_weights`: the layers' linears and the LM head read int8 weights (lanes/model/int8_linear.py;
        the fused layers only)."""
        self.model = model
        self.pool = pool
        self.device = pool.kv.device
        model.config._attn_implementation = POOL_ATTENTION
        # Running the decoder and the LM head separately lets us apply the head to chosen rows only.
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        if tp is not None and tp.rank > 0:
            self.lm_head = _no_head  # only rank 0 samples: a worker's forward ends at the hidden states
        self.share_forward = share_forward
        # Gemma-2 caps its logits in the CausalLM forward, which we bypass to run the head on chosen rows.
        self.logit_softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        self.num_kv_heads = pool.shape.num_kv_heads  # this rank's, under tensor parallelism
        text = model.config.get_text_config()
        self._group = text.num_attention_heads // (self.num_kv_heads * (tp.size if tp is not None else 1))
        # The in-place kernel needs Triton on a GPU; tests force it on CPU under TRITON_INTERPRET=1.
        self.attention_kernel = self.device.type == "cuda" if attention_kernel is None else attention_kernel
        self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 4
        self._neg = torch.finfo(model.dtype).min
        # Llama-family and Gemma models run our fused layers (Triton on CUDA, torch on CPU); others HF's modules.
        use_fused = supports(model) if fused_layers is None else fused_layers
        if tp is not None and not use_fused:
            raise ValueError("tensor parallelism runs the fused Llama-family layers only (engine.fused_layers)")
        row_linear = row_parallel_linear(tp) if tp is not None else torch.nn.functional.linear
        self.fused = FusedDecoder(model, pool, self.device.type == "cuda" or self.attention_kernel,
                                  row_linear) if use_fused else None
        self.head_int8 = None
        if int8_weights:
            if self.fused is None:
                raise ValueError("int8 weights run in the fused Llama-family layers only (draft.quantization)")
            self.fused.quantize_int8()
            self.head_int8 = int8.quantize(self.lm_head.weight, keep_dense=True)
        use_graphs = self.device.type == "cuda" and self.attention_kernel if cuda_graphs is None else cuda_graphs
        self.graphs = GraphedForward(self._logits, pool.pad_slot, self.device, pool.shape.num_slots) if use_graphs else None
        # Whole-prompt prefill through our fused layers replays graphs too (HF's modules build masks
        # and caches on the host, which a graph would freeze).
        self.prefill_graphs = (GraphedPrefill(self._prompt_logits, pool.pad_slot, self.device, pool.shape.num_slots,
                                              pool.shape.capacity_tokens)
                               if use_graphs and self.fused is not None else None)
        self._row_index = torch.arange(pool.shape.num_slots + 1, device=self.device)  # sliced, not rebuilt, per forward

    def rows(self, slots: list[int], kv_lens: list[int]) -> Rows:
        """`Rows` from host lists, in one host-to-device copy."""
        slot_ids, starts = to_device([slots, kv_lens], torch.long, self.device)
        return Rows(slot_ids, starts, max(kv_lens))

    @torch.inference_mode()
    def forward(self, rows: Rows, input_ids: torch.Tensor, keep: torch.Tensor | None = None,
                prefill: bool = False) -> torch.Tensor:
        """Run the model on `input_ids` [B, Q] appended after `rows.starts` tokens of each row's slot.

        Writes the Q new keys/values of every row (padding included, past the row's valid length,
        where nothing reads them). Returns float32 logits [B, Q, V], or [B, V] at the per-row
        query index `keep` [B] (on the device) when given. `prefill` forwards (prompt chunks, draft
        catch-up) run eagerly, except whole prompts (every row from position 0, last positions
        kept), which replay a graph per (batch, width) bucket where one fits (lanes/model/cuda_graphs.py).
        Nothing here reads a device value back.
        """
        batch, q_len = input_ids.shape
        assert rows.slot_ids.shape[0] == batch == rows.starts.shape[0], (rows.slot_ids.shape, input_ids.shape)
        capacity = self.pool.shape.capacity_tokens
        assert rows.max_start + q_len <= capacity, f"row would write past the slot capacity {capacity}"
        input_ids = input_ids.to(self.device)
        table_rows = self.pool.sync_block_table()  # blocks given back since the last forward (rollback, frees)
        if self.share_forward is not None:  # rank 0 of a tensor-parallel group: the workers run it too
            self.share_forward(rows, input_ids, keep, prefill, table_rows)
        index = self._row_index[:batch]
        if (prefill and self.prefill_graphs is not None and keep is not None and rows.max_start == 0
                and self.prefill_graphs.fits(batch, q_len)):
            return self.prefill_graphs(rows.slot_ids, input_ids, keep)  # [B, V], replayed
        if self.graphs is not None and not prefill and q_len <= GRAPH_MAX_Q and self._kernel_fits(q_len):
            logits = self.graphs(rows.slot_ids, rows.starts, input_ids)  # [B, Q, V], replayed
            return logits[index, keep] if keep is not None else logits
        starts = rows.starts.to(torch.int32)
        hidden = self._hidden(rows.slot_ids, starts, input_ids, rows.max_start + q_len)  # [B, Q, H]
        if keep is not None:
            # Only the rows' last tokens need logits: skip the LM head on the rest (prefill, catch-up).
            hidden = hidden[index, keep]  # [B, H]
        return self._head(hidden)

    def capture_graphs(self, q_lens: Iterable[int], prefill: bool) -> float:
        """Capture now, on the pool's pad slot, the graphs that live steps would capture on first use:
        the few-token forward of every batch bucket at each of `q_lens`, and with `prefill` every
        whole-prompt (batch, width) bucket. A first use in a live step stalls it for the capture, and
        for a Triton compile where the bucket's shape is new (0.9 s for a 7B verify graph on an H200,
        benchmarks/results/serving_overhead_h200_engine_runs); vLLM captures at start for the same
        reason. Through `forward`, so tensor-parallel workers capture theirs too. Returns the ms spent
        (off CUDA, where tests force "graphs" on, they run eagerly on their padded buffers)."""
        if self.graphs is None:
            return 0.0
        start_s = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        shapes = [(b, q, False) for b in self.graphs.buckets for q in sorted(set(q_lens))
                  if q <= GRAPH_MAX_Q and self._kernel_fits(q)]
        if prefill and self.prefill_graphs is not None:
            shapes += [(b, w, True) for b in self.prefill_graphs.batches for w in self.prefill_graphs.widths
                       if self.prefill_graphs.fits(b, w)]
        for batch, q_len, whole_prompt in shapes:
            self.pad_forward(batch, 0, q_len, keep_last=whole_prompt, prefill=whole_prompt)
        if prefill and self.prefill_graphs is not None:
            # Chunks that start past position 0 (a prompt's rest after a prefix-cache hit, a long
            # prompt's later chunks) run eagerly; their first use of a kernel specialisation compiled
            # it mid-step (0.4-1.2 s stalls on an H200). Widths either side of each attention tile
            # size, multiples of 16 and not, compile those now. Not yet measured on a GPU.
            for q_len in EAGER_CHUNK_WIDTHS:
                if self.pool.shape.block_size + q_len <= self.pool.shape.capacity_tokens:
                    self.pad_forward(1, self.pool.shape.block_size, q_len, keep_last=True, prefill=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # Against the memory plan's estimate of what graphs hold (lanes/model/memory_profile.py).
            log.info("captured %d CUDA graphs of a %d-layer model: %.2f GiB more reserved", len(shapes),
                     self.model.config.get_text_config().num_hidden_layers,
                     (torch.cuda.memory_reserved(self.device) - reserved) / 2**30)
        return (time.perf_counter() - start_s) * 1e3

    def pad_forward(self, batch: int, start: int, q_len: int, keep_last: bool, prefill: bool) -> None:
        """A forward of `batch` rows on the pool's pad slot (writes only its pad block)."""
        rows = Rows(torch.full((batch,), self.pool.pad_slot, dtype=torch.long, device=self.device),
                    torch.full((batch,), start, dtype=torch.long, device=self.device), start)
        ids = torch.zeros(batch, q_len, dtype=torch.long, device=self.device)
        keep = torch.full((batch,), q_len - 1, dtype=torch.long, device=self.device) if keep_last else None
        self.forward(rows, ids, keep=keep, prefill=prefill)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden states [..., H], soft-capped as HF's forward does (in the model's dtype)."""
        if self.head_int8 is not None:
            logits = int8.int8_linear(hidden, self.head_int8, self.lm_head.bias)
        else:
            logits = self.lm_head(hidden)
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits.float()

    def _logits(self, slot_ids: torch.Tensor, starts: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The graph body: few-token forward through the in-place kernel, all logits [B, Q, V]."""
        return self._head(self._hidden(slot_ids, starts, input_ids, None))

    def _prompt_logits(self, slot_ids: torch.Tensor, starts: torch.Tensor, input_ids: torch.Tensor,
                       keep: torch.Tensor) -> torch.Tensor:
        """The prefill graph body: rows from position 0 (`starts` zeros), logits [B, V] at `keep` [B]."""
        hidden = self._hidden(slot_ids, starts, input_ids, input_ids.shape[1])  # [B, W, H]
        return self._head(hidden[self._row_index[:input_ids.shape[0]], keep])

    def _hidden(self, slot_ids, starts, input_ids, longest: int | None) -> torch.Tensor:
        positions = starts[:, None].long() + torch.arange(input_ids.shape[1], device=self.device)  # [B, Q]
        meta = self._meta(slot_ids, starts, positions, longest)
        if self.fused is not None:
            return self.fused(input_ids, meta)
        return self.decoder(
            input_ids=input_ids,
            # A prepared 4D mask makes HF skip its own mask building; pool attention ignores it.
            attention_mask=meta.mask if meta.mask is not None else self._no_mask,
            position_ids=positions,
            past_key_values=PoolCache(self.pool, slot_ids, positions),
            use_cache=True,
            pool_meta=meta,
        ).last_hidden_state

    def _kernel_fits(self, q_len: int) -> bool:
        from lanes.model.triton_attention import MAX_ROWS, head_dim_supported

        return (self.attention_kernel and q_len * self._group <= MAX_ROWS
                and head_dim_supported(self.pool.shape.head_dim))

    def _meta(self, slot_ids, starts, positions, longest: int | None) -> PoolAttentionMeta:
        from lanes.model.triton_attention import split_count

        batch, q_len = positions.shape
        # The pool's device table: a CUDA graph reads it at its fixed address, updated in place between replays.
        table = self.pool.block_table_device
        if self._kernel_fits(q_len):
            splits = split_count(self.pool.shape.capacity_tokens, batch, self.num_kv_heads, self._num_sms)
            return PoolAttentionMeta(slot_ids, starts, None, None, splits, True, table)
        if longest == q_len:  # every row starts at position 0: causal attention over its own tokens, no mask
            return PoolAttentionMeta(slot_ids, starts, q_len, None, 1, False, table)
        kv_bound = min(self.pool.shape.capacity_tokens, -(-longest // KV_BOUND_MULTIPLE) * KV_BOUND_MULTIPLE)
        return PoolAttentionMeta(slot_ids, starts, kv_bound, self._causal_mask(positions, kv_bound), 1, False, table)

    @property
    def _no_mask(self) -> torch.Tensor:
        return torch.zeros(1, 1, 1, 1, dtype=self.model.dtype, device=self.device)

    def _causal_mask(self, positions: torch.Tensor, kv_bound: int) -> torch.Tensor:
        # Additive mask [B, 1, Q, kv_bound]: query at absolute position t sees keys 0..t of its own slot.
        keys = torch.arange(kv_bound, device=self.device)
        allowed = keys[None, None, :] <= positions[:, :, None]
        zero = torch.zeros((), dtype=self.model.dtype, device=self.device)
        neg = torch.full((), self._neg, dtype=self.model.dtype, device=self.device)
        return torch.where(allowed, zero, neg)[:, None]


def _no_head(hidden: torch.Tensor) -> torch.Tensor:
    return hidden[..., :0]
