"""The elementwise work of a Llama-family layer as one kernel each: residual add + RMSNorm,
rotary embedding + KV-pool write, SiLU-and-multiply; and Gemma's variants of the norm (scaled by
1 + w) and of the activation (tanh-approximated GELU).

Unfused, HF spends ~35 small kernels a layer on these (norms alone are six), which on a small draft
model costs as much GPU time as the GEMMs (benchmarks/gpu_check.py --profile). Each function has a Triton
kernel (CUDA; tests run it under TRITON_INTERPRET=1 on CPU) and a torch path with HF's exact
arithmetic (CPU serving). Rounding follows HF: values are rounded to the model dtype where HF's
eager code rounds them, so bf16 results match HF's to the last bit or one ulp.
"""

import torch
import triton
import triton.language as tl
from transformers.models.llama.modeling_llama import rotate_half

from lanes.model.pool_cache import block_positions
from lanes.model.triton_attention import tanh


# ---- residual add + RMSNorm --------------------------------------------------------------------

@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, rows, hidden,
                         HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    ok = (row < rows) & (cols < hidden)
    at = row * hidden + cols
    x = tl.load(x_ptr + at, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # HF adds in the model dtype: round the sum before normalising it.
        x = (x.to(tl.float32) + tl.load(res_ptr + at, mask=ok, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + at, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1, keep_dims=True) / hidden + eps)  # [ROWS, 1]
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma scales by (1 + w) in float32 and rounds once, at the end
        out = xf * rstd * (1.0 + w)
    else:  # Llama rounds the normalised value to the model dtype before the weight
        out = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=ok)


def rows_per_program(row_elements: int) -> int:
    """Rows one program of a row-wise kernel takes: one row of a model's hidden size (>= 2048), several
    of a short one (a q/k head's 128 for Qwen3's and Gemma-3's head norms, a small draft's hidden), so
    that no program moves fewer than ~2048 elements: a program per 128-element row is a launch grid of
    rows x heads tiny programs. A function of the row's length only, never of the batch: Triton compiles
    once per constexpr value, and a new batch size must not compile (and stall) at serve time."""
    return max(1, 2048 // triton.next_power_of_2(row_elements))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (RMSNorm(x + residual) * weight, x + residual). Without a residual
    (the first layer) the new residual stream is x itself."""
    if not use_triton:
        summed = x if residual is None else residual + x
        variance = summed.float().pow(2).mean(-1, keepdim=True)
        normed = (summed.float() * torch.rsqrt(variance + eps)).to(summed.dtype)
        return weight * normed, summed
    return _add_rms_norm_triton(x, residual, weight, eps, unit_offset=False)


def add_gemma_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm with Gemma's norm: RMSNorm(x + residual) * (1 + weight), all in float32 and rounded
    to the model dtype once (HF's Gemma2RMSNorm / Gemma3RMSNorm; float32 for a float64 model too)."""
    if not use_triton:
        summed = x if residual is None else residual + x
        xf = summed.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (1.0 + weight.float())).to(summed.dtype), summed
    return _add_rms_norm_triton(x, residual, weight, eps, unit_offset=True)


def _add_rms_norm_triton(x, residual, weight, eps: float, unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    rows, hidden = x.shape
    out = torch.empty_like(x)
    res_out = x if residual is None else torch.empty_like(x)
    per_program = rows_per_program(hidden)
    _add_rms_norm_kernel[(triton.cdiv(rows, per_program),)](
        x, residual if residual is not None else x, weight, out, res_out, eps, rows, hidden,
        HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, ROWS=per_program,
        BLOCK=triton.next_power_of_2(hidden))
    return out, res_out


# ---- rotary embedding + KV write ----------------------------------------------------------------

# Heads one program of _rope_store_kernel takes: all of a small model's (the tests'), a slice of a large
# one's (48 for Llama-3-8B: 6 programs a token), so that a batch-1 decode step still spreads over SMs.
HEADS_PER_PROGRAM = 8


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, table_ptr, slot_ptr, start_ptr, q_out_ptr, k_pool_ptr, v_pool_ptr,
                       q_len, stride_kb, stride_kh, stride_kn, stride_table,
                       Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
                       HEADS: tl.constexpr):
    token = tl.program_id(0)
    # [HEADS, 1], of 0 .. Q_HEADS + 2 * KV_HEADS - 1: query heads, key heads, value heads
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]
    is_query = head < Q_HEADS
    is_value = (head >= Q_HEADS + KV_HEADS) & (head < Q_HEADS + 2 * KV_HEADS)
    is_key = (head >= Q_HEADS) & (head < Q_HEADS + KV_HEADS)
    row = token // q_len
    pos = tl.load(start_ptr + row).to(tl.int64) + token % q_len
    slot = tl.load(slot_ptr + row).to(tl.int64)
    page = tl.load(table_ptr + slot * stride_table + pos // PAGE).to(tl.int64)  # the block holding pos
    at = page * stride_kb + (pos % PAGE) * stride_kn
    dims = tl.arange(0, HALF)[None, :]  # [1, HALF]
    present = is_query | is_key | is_value
    src = qkv_ptr + (token * (Q_HEADS + 2 * KV_HEADS) + tl.where(present, head, 0)) * 2 * HALF
    x1 = tl.load(src + dims, mask=present, other=0.0)
    x2 = tl.load(src + HALF + dims, mask=present, other=0.0)
    c = tl.load(cos_ptr + pos * HALF + dims).to(tl.float32)
    s = tl.load(sin_ptr + pos * HALF + dims).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    # Values are stored as they are; queries and keys rotated and rounded to the model dtype.
    out1 = tl.where(is_value, x1, (x1f * c - x2f * s).to(x1.dtype))
    out2 = tl.where(is_value, x2, (x2f * c + x1f * s).to(x1.dtype))
    # Each head goes to one of three places; the offsets of the other two are clamped to 0 and masked.
    q_dst = q_out_ptr + (token * Q_HEADS + tl.where(is_query, head, 0)) * 2 * HALF
    k_dst = k_pool_ptr + at + tl.where(is_key, head - Q_HEADS, 0) * stride_kh
    v_dst = v_pool_ptr + at + tl.where(is_value, head - Q_HEADS - KV_HEADS, 0) * stride_kh
    tl.store(q_dst + dims, out1, mask=is_query)
    tl.store(q_dst + HALF + dims, out2, mask=is_query)
    tl.store(k_dst + dims, out1, mask=is_key)
    tl.store(k_dst + HALF + dims, out2, mask=is_key)
    tl.store(v_dst + dims, out1, mask=is_value)
    tl.store(v_dst + HALF + dims, out2, mask=is_value)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, block_table: torch.Tensor,
               slot_ids: torch.Tensor, starts: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               q_heads: int, use_triton: bool) -> torch.Tensor:
    """Rotate the new queries and keys, write keys and values into their rows' blocks.

    qkv [B, Q, (q_heads + 2 kv_heads) * D], the fused projection; cos/sin [positions, D/2], HF's
    table (rounded to the model dtype); row b's tokens sit at starts[b] .. starts[b] + Q - 1 of
    slot slot_ids[b], whose blocks are block_table[slot] [slots, blocks_per_slot] int32; pools
    [blocks, kv_heads, block_size, D]. Returns the rotated queries [B, Q, q_heads, D].
    """
    if not use_triton:
        return _rope_store_torch(qkv, cos, sin, block_table, slot_ids, starts, k_pool, v_pool, q_heads)
    batch, q_len, _ = qkv.shape
    kv_heads, head_dim = k_pool.shape[1], k_pool.shape[3]
    assert qkv.is_contiguous() and k_pool.stride(-1) == 1 and k_pool.stride() == v_pool.stride()
    assert block_table.stride(-1) == 1
    q_out = torch.empty(batch, q_len, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(batch * q_len, triton.cdiv(q_heads + 2 * kv_heads, HEADS_PER_PROGRAM))](
        qkv, cos, sin, block_table, slot_ids, starts, q_out, k_pool, v_pool, q_len,
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_table.stride(0),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HALF=head_dim // 2, PAGE=k_pool.shape[2], HEADS=HEADS_PER_PROGRAM,
    )
    return q_out


def _rope_store_torch(qkv, cos, sin, block_table, slot_ids, starts, k_pool, v_pool, q_heads: int) -> torch.Tensor:
    batch, q_len, _ = qkv.shape
    kv_heads, head_dim = k_pool.shape[1], k_pool.shape[3]
    heads = qkv.view(batch, q_len, q_heads + 2 * kv_heads, head_dim)
    query, key, value = heads.split([q_heads, kv_heads, kv_heads], dim=2)  # [B, Q, heads, D]
    positions = starts[:, None].long() + torch.arange(q_len, device=qkv.device)  # [B, Q]
    cos_full = torch.cat((cos[positions], cos[positions]), dim=-1)[:, :, None]  # [B, Q, 1, D]
    sin_full = torch.cat((sin[positions], sin[positions]), dim=-1)[:, :, None]
    blocks, offsets = block_positions(block_table, slot_ids, positions, k_pool.shape[2])  # [B, Q] each
    k_pool[blocks, :, offsets] = key * cos_full + rotate_half(key) * sin_full
    v_pool[blocks, :, offsets] = value
    return query * cos_full + rotate_half(query) * sin_full


# ---- activation and multiply (SiLU: Llama family; tanh-approximated GELU: Gemma) --------------------

@triton.jit
def _act_mul_kernel(gate_up_ptr, out_ptr, rows, inter, GELU_TANH: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    ok = (row < rows) & (cols < inter)
    gate = tl.load(gate_up_ptr + row * 2 * inter + cols, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * inter + inter + cols, mask=ok, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    if GELU_TANH:
        # HF's gelu_pytorch_tanh: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))). A literal, not a
        # named global: Triton's interpreter cannot scale a tensor by a global constexpr.
        act = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        act = g / (1.0 + tl.exp(-g))
    act = act.to(gate.dtype).to(tl.float32)  # HF rounds the activation first
    tl.store(out_ptr + row * inter + cols, (act * up).to(gate.dtype), mask=ok)


def silu_and_mul(gate_up: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    inter = gate_up.shape[-1] // 2
    if not use_triton:
        return torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    return _act_mul_triton(gate_up, gelu_tanh=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> gelu_tanh(gate) * up [T, I]: Gemma's GeGLU
    (hidden_activation gelu_pytorch_tanh)."""
    inter = gate_up.shape[-1] // 2
    if not use_triton:
        return torch.nn.functional.gelu(gate_up[..., :inter], approximate="tanh") * gate_up[..., inter:]
    return _act_mul_triton(gate_up, gelu_tanh=True)


def _act_mul_triton(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    assert gate_up.is_contiguous()
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * inter)
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    per_program = rows_per_program(inter)
    _act_mul_kernel[(triton.cdiv(rows, per_program), triton.cdiv(inter, block))](
        gate_up, out, rows, inter, GELU_TANH=gelu_tanh, ROWS=per_program, BLOCK=block)
    return out
