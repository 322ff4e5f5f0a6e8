"""Residual add + RMSNorm and the linear after it as one kernel, for the few rows of a decode or draft
step: the norm before the QKV projection, and the norm before the gate/up projection with the
activation-and-multiply after it. A Llama layer at one row then runs seven kernels, not ten.

Why: at batch 1 a TinyLlama-shaped draft token is 22 layers of eleven kernels, and the three
elementwise ones (two norms, the activation) took ~5 us a layer on an H100 with the gaps between
kernels (benchmarks/results/kernels_h100/merge/after/profile_steps.json), 0.1 ms of a ~1.3 ms token.
A better GEMV alone does not help (benchmarks/results/gemv_h100: at one row a Triton linear ties cuBLAS
at its best tile); fewer kernels do.

Each program owns BLOCK_N output columns (with ACT, the BLOCK_N gate columns and the matching up
columns) and streams its rows of the weight once. It first walks the input rows for their sums of
squares (the whole row is needed before any normalised value), then again, normalising each chunk as
it multiplies it: the rows are a few KiB read from L1/L2, the weight tens of MiB from HBM. Program 0
also stores the new residual stream. Rounding follows lanes/model/fused_ops.py (HF's): the sum and
the normalised value rounded to the model dtype, the linear summed in float32 and rounded once, the
activation rounded before the multiply.

Llama's norm and SiLU only (Gemma scales by 1 + w, norms its outputs too and uses a GELU: it keeps the
separate kernels).
"""

import torch
import triton
import triton.language as tl

MAX_ROWS = 4  # more rows: the linear is no longer only a weight stream; the norm and cuBLAS's GEMM take it


@triton.jit
def _summed(x_ptr, res_ptr, at, ok, HAS_RESIDUAL: tl.constexpr):
    """x + residual at `at`, rounded to the model dtype as HF adds them."""
    x = tl.load(x_ptr + at, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + at, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _norm_linear_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, eps, rows, N, K,
                        HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    first = tl.program_id(0) == 0
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns (with ACT: gate columns)
    r = tl.arange(0, ROWS)[:, None]  # [R, 1]
    squares = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
        ok = (r < rows) & (k < K)
        s = _summed(x_ptr, res_ptr, r * K + k, ok, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            if first:
                tl.store(res_out_ptr + r * K + k, s, mask=ok)
        squares += s.to(tl.float32) * s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=1, keep_dims=True) / K + eps)  # [R, 1]
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        ok = (r < rows) & (k < K)
        s = _summed(x_ptr, res_ptr, r * K + k, ok, HAS_RESIDUAL)
        weight = tl.load(norm_w_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        # Llama rounds the normalised value to the model dtype, then the product with the weight.
        normed = ((s.to(tl.float32) * rstd).to(s.dtype).to(tl.float32) * weight).to(s.dtype).to(tl.float32)
        w_ok = (n[:, None] < N) & (k < K)
        w = tl.load(w_ptr + n[:, None] * K + k, mask=w_ok, other=0.0).to(tl.float32)  # [BN, BK]
        acc += tl.sum(normed[:, None, :] * w[None, :, :], axis=2)
        if ACT:  # the up projection's rows follow the gate's N rows
            w = tl.load(w_ptr + (n[:, None] + N) * K + k, mask=w_ok, other=0.0).to(tl.float32)
            up += tl.sum(normed[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        if ACT:
            up += tl.load(b_ptr + N + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype)
    if ACT:  # SiLU as _act_mul_kernel: gate and up rounded as the linear's outputs, the activation rounded
        g = out.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        out = (silu * up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + r * N + n[None, :], out, mask=(r < rows) & (n[None, :] < N))


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `norm_linear` takes x [T, K] into weight [N, K]: at most MAX_ROWS rows, contiguous, one dtype."""
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.is_contiguous() and weight.is_contiguous()
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def tile(rows: int, act: bool) -> tuple[int, int, int, int]:
    """(padded rows, BLOCK_N, BLOCK_K, warps). Eight weight rows a program (the best one-row tile of
    benchmarks/results/gemv_h100's sweep: hundreds of programs for every SM to keep loads in flight),
    and a [rows, 8, BLOCK_K] product of at most 4,096 float32 values a weight tile, 64 a thread. A function
    of the padded row count only: batch sizes 1, 2 and 3-4 compile one kernel each."""
    padded = triton.next_power_of_2(rows)
    return padded, 8, (256 if act else 512) // padded, 2


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None, silu_and_mul: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, K] -> (linear(RMSNorm(x + residual) * norm_weight), x + residual).

    With `silu_and_mul`, weight is the gate and up projections stacked [2I, K] and the output
    silu(gate) * up [T, I]. Without a residual (the first layer) the stream is x itself.
    """
    rows, k = x.shape
    n = weight.shape[0] // 2 if silu_and_mul else weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty_like(x)
    padded, block_n, block_k, warps = tile(rows, silu_and_mul)
    _norm_linear_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight, weight, bias if bias is not None else weight,
        out, res_out, eps, rows, n, k, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        ACT=silu_and_mul, ROWS=padded, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out, res_out
