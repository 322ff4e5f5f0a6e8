"""Weight-only int8 linears for the draft model: each weight stored as int8 with one float32 scale per
output channel, read by a Triton kernel that multiplies in the activations' dtype.

Why: at batch 1 the draft's step is its weights' bytes over the memory bandwidth, plus the ramps and
tails of its 256 kernels a token (benchmarks/results/kernels_h100/). int8 halves the bytes. The draft
only proposes: the target's rejection sampling keeps the output lossless whatever the draft is, so a
quantized draft changes the acceptance rate, never the output's distribution (the drafts' probabilities
are the quantized model's own, tests/test_int8_linear.py).

One kernel, two paths. One row (a draft token at batch 1): a program owns BLOCK_N output channels and
streams their int8 rows along K, summing in float32. 2-16 rows: tensor-core tiles (tl.dot), the int8
tile converted to the activations' dtype, exact for integers up to 127. Past 16 rows (prompt prefill,
and at batch > 16 the draft's forwards) cuBLAS runs the GEMM on the weight as loaded, which stays in
memory: on an H100 the kernel took 0.53-1.00x cuBLAS's time on the bf16 weights at 16 rows, but up to
1.28x at 32 and 1.54x at 64 (benchmarks/results/int8_tiles_h100/). Dequantized there once a call
instead, a served unified engine at 64 in flight gave 0.59x the bf16 draft's tok/s
(benchmarks/results/int8_draft_h100/). Each forward is one model's either way, so the probabilities a
token was drafted from are the ones its verification divides by.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # CPU tests run the kernel in Triton's interpreter
MAX_KERNEL_ROWS = 16  # more rows (prompts, batches past 16): cuBLAS on the weight as loaded (`dense`)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Int8Weight:
    """A linear's weight [N, K] as int8 `q` with per-output-channel `scale` [N] (float32): W ≈ q * scale[:, None].
    `dense`: the weight as loaded, for forwards of more rows than the kernel takes (None: dequantized there)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype  # the weight's dtype before quantization: what dequantize returns
    dense: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale[:, None]).to(self.dtype)


def quantize(weight: torch.Tensor, keep_dense: bool = False) -> Int8Weight:
    """Symmetric per-output-channel int8: each row's largest magnitude maps to 127. `keep_dense`: hold a
    reference to `weight` (no copy) for forwards past MAX_KERNEL_ROWS."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return Int8Weight(q, scale.contiguous(), weight.dtype, weight.detach() if keep_dense else None)


def _configs(tiles: tuple[tuple[int, int, int], ...]) -> list[triton.Config]:
    """Tiles (BLOCK_N, BLOCK_K, warps) timed once per (N, K, row tile) on the GPU, at the warm-up before a
    graph's capture: four a path, so that a replica's first start compiles and times few. Under Triton's
    interpreter (CPU tests) one tile: the interpreter runs what a config says, not how fast."""
    if INTERPRET:
        tiles = ((16, 32, 4),)
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in tiles]


@triton.jit
def _int8_linear_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, rows, N, K, stride_x,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UPCAST: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output channels
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(q_ptr + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        acc = acc * tl.load(scale_ptr + n, mask=n < N, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)
    else:
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(q_ptr + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0)
            x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=(m[:, None] < rows) & (k[None, :] < K),
                        other=0.0)
            if UPCAST:  # float32 activations: a full-precision product (and the interpreter's bf16 dot is wrong)
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        acc = acc * tl.load(scale_ptr + n, mask=n < N, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(m[:, None] < rows) & (n[None, :] < N))


# One kernel, two tuners: a row streams along K in long tiles; tl.dot needs tiles of 16 or more along every side.
# The tiles are each draft linear's fastest in a sweep of twelve (one row) and eight (16 rows) on an H100
# (`gpu_check.py --int8-tiles`, benchmarks/results/int8_tiles_h100/). The small linears (QKV, o_proj, down_proj)
# want few channels a program and long loads along K (2,048): more bytes in flight, fewer round trips.
ONE_ROW_TILES = ((4, 2048, 4), (8, 512, 2), (8, 2048, 8), (16, 512, 4))
ROW_TILES = ((32, 256, 4), (32, 512, 4), (64, 128, 4), (64, 256, 4))
_ONE_ROW = triton.autotune(_configs(ONE_ROW_TILES), key=["N", "K"])(_int8_linear_kernel)
_ROW_TILES = triton.autotune(_configs(ROW_TILES), key=["N", "K", "BLOCK_M"])(_int8_linear_kernel)


def _block_m(rows: int) -> int:
    """1 (the reduction path), else tl.dot's row tile: a power of two, at least 16."""
    return 1 if rows == 1 else max(16, triton.next_power_of_2(rows))


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight.dequantize(), bias) for x [..., K]: the kernel up to MAX_KERNEL_ROWS rows of a
    dtype it takes, on a GPU (or under the interpreter); else F.linear on the weight as loaded where it
    is kept, or on the dequantized one."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    if not 0 < rows <= MAX_KERNEL_ROWS or x.dtype not in KERNEL_DTYPES or not (x.is_cuda or INTERPRET):
        dense = weight.dense if weight.dense is not None else weight.dequantize()
        return F.linear(x, dense.to(x.dtype), bias)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_m = _block_m(rows)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(rows, block_m))  # noqa: E731
    kernel = _ONE_ROW if block_m == 1 else _ROW_TILES
    kernel[grid](x2, weight.q, weight.scale, bias if bias is not None else weight.scale, out, rows, n, k, x2.stride(0),
                 HAS_BIAS=bias is not None, BLOCK_M=block_m, UPCAST=INTERPRET or x.dtype == torch.float32)
    return out.view(*x.shape[:-1], n)

