"""A linear layer over a few rows (a decode or verify step at small batch) as one Triton kernel that
streams the weight once, at close to the memory bandwidth.

Why: at one to a few rows a linear does almost no arithmetic; its time is the weight's bytes over
the bandwidth. cuBLAS's kernels at these shapes read the TinyLlama draft's weights at 72 % of the
copy bandwidth on an H100 (benchmarks/results/step_floor_h100/README.md), and the draft's GEMMs are
most of its step. Here each program owns BLOCK_N output columns for every row and walks the
reduction dimension in [BLOCK_N, BLOCK_K] tiles of the weight, read once, contiguous along K; the
few rows of x are re-read from L2. Rows are summed in float32, as cuBLAS does, and rounded once.
Past four rows the tile is a tensor-core product (tl.dot), its rows padded to 16.

Tile sizes are a function of the weight's shape only, never of the row count, so no batch size
compiles a new kernel while serving (the row count is padded to 1, 2, 4 or 16, one compile each).
"""

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # more rows: the linear is no longer a weight stream, cuBLAS's GEMMs take it
DOT_ROWS = 16  # rows past 4 run on tensor cores (tl.dot), padded to its smallest tile


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, rows, N, K, stride_x,
                 HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    r = tl.arange(0, ROWS)  # [R]
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        x = tl.load(x_ptr + r[:, None] * stride_x + k[None, :], mask=(r[:, None] < rows) & (k[None, :] < K),
                    other=0.0)  # [R, BK]
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        else:  # one to four rows: a reduction, no tensor-core tile to pad
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + r[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(r[:, None] < rows) & (n[None, :] < N))


def tiles(n: int, k: int, padded: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a weight [n, k] and `padded` rows: about 4,096 weight elements
    a tile (8 KiB in bf16 a loop step), with ~256 programs or more over n where the weight allows, so
    that every SM of an H100 (132) holds two or more programs' loads in flight. The reduction path's
    product [rows, BLOCK_N, BLOCK_K] stays within 8,192 float32 values (64 registers a thread)."""
    block_n = 8 if n <= 4096 else 16 if n <= 16384 else 32
    if padded == DOT_ROWS:  # tl.dot's tile is at least 16 wide along every dimension
        block_n = max(block_n, 16)
        return block_n, min(triton.next_power_of_2(k), 4096 // block_n), 4
    return block_n, min(triton.next_power_of_2(k), 4096 // block_n, 8192 // (padded * block_n)), 4


def padded_rows(rows: int) -> int:
    return triton.next_power_of_2(rows) if rows <= 4 else DOT_ROWS


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes x @ weight.T: few rows, a contiguous 2-D weight of x's dtype. float32 runs
    tl.dot at full precision (not TF32): the GPU checks' float32 models take the kernel too."""
    rows = x.numel() // x.shape[-1]
    return (rows <= MAX_ROWS and weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.dtype == weight.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] of at most MAX_ROWS rows, weight [N, K]; `tile`
    overrides `tiles` (benchmarks/gpu_check.py --gemv-sweep times the alternatives)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    padded = padded_rows(rows)
    block_n, block_k, warps = tile or tiles(n, k, padded)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, out, rows, n, k, x2.stride(0),
        HAS_BIAS=bias is not None, ROWS=padded, BLOCK_N=block_n, BLOCK_K=block_k,
        USE_DOT=padded == DOT_ROWS, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps)
    return out.view(*x.shape[:-1], n)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `gemv` where the linear is a weight stream (few rows), cuBLAS otherwise."""
    if fits(x, weight):
        return gemv(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
