"""lanes/model/gemv.py under Triton's CPU interpreter (tests/conftest.py): the few-row linear against
a float64 reference, on shapes that are not multiples of its tiles, and where it hands over to cuBLAS.

The interpreter's tl.dot gives garbage for bfloat16 inputs (it does so for any kernel; on a GPU the
same kernel is exact), so bfloat16 is checked on the reduction path (up to 4 rows) only; the GPU
check (benchmarks/gpu_check.py --gemv-sweep) compares every path with cuBLAS in bfloat16."""

import pytest
import torch
import torch.nn.functional as F

from lanes.model.gemv import DOT_ROWS, MAX_ROWS, fits, gemv, padded_rows, small_linear, tiles

# Relative to the output's largest value: float32 accumulation over K, one rounding to the dtype.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _check(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, lead: tuple = ()) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(*lead, rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    out = gemv(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert out.shape == (*lead, rows, n) and out.dtype == dtype
    assert (out.double() - ref).abs().max() <= TOL[dtype] * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16])
def test_every_row_count(rows, dtype):
    _check(rows, 72, 136, dtype, bias=True)


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_bfloat16_rows_by_reduction(rows):
    _check(rows, 40, 264, torch.bfloat16, bias=False)


def test_leading_dims_and_long_reduction():
    """[B, Q, K] input as the fused layers pass it (B x Q rows), and a K spanning several tiles."""
    _check(2, 24, 1100, torch.float32, bias=False, lead=(2,))


def test_tiles_depend_on_the_weight_and_path_only():
    """Tiles are a function of (n, k, padded rows): batch sizes that pad alike compile one kernel."""
    assert [padded_rows(r) for r in (1, 2, 3, 4, 5, 16)] == [1, 2, 4, 4, DOT_ROWS, DOT_ROWS]
    for n, k in ((2560, 2048), (2048, 5632), (22016, 4096), (32000, 2048)):
        for padded in (1, 2, 4):
            block_n, block_k, _ = tiles(n, k, padded)
            assert padded * block_n * block_k <= 8192  # the reduction's product stays in registers
        assert tiles(n, k, DOT_ROWS)[0] >= 16  # tl.dot's smallest tile


def test_small_linear_hands_larger_work_to_cublas():
    w = torch.randn(8, 32)
    x_many = torch.randn(MAX_ROWS + 1, 32)
    assert not fits(x_many, w) and fits(x_many[:MAX_ROWS], w)
    assert not fits(x_many[:1].double(), w.double())  # no float64 path
    assert not fits(x_many[:1], w.T)  # a transposed (non-contiguous) weight
    torch.testing.assert_close(small_linear(x_many, w), F.linear(x_many, w))
    torch.testing.assert_close(small_linear(x_many[:3], w), F.linear(x_many[:3], w), rtol=1e-5, atol=1e-5)


def test_engine_through_gemv_decodes_greedy_equal_to_hf():
    """The engine's linears (layers and LM head) through the kernel, float32 (tl.dot at full precision):
    speculative greedy output equal to HF's."""
    from lanes.sample.params import SamplingParams
    from tests.conftest import VOCAB, make_pair
    from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion, small_engine

    target, draft = make_pair("llama", dtype="float32")
    prompts = random_prompts(3, VOCAB, 2, 40, seed=5)
    engine = small_engine(target, draft, gemv_kernel=True, num_speculative_tokens=3)
    assert engine.draft.linear is small_linear and engine.draft.fused.linear is small_linear
    outputs = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=10, ignore_eos=True))
                                         for i, p in enumerate(prompts)})
    assert [outputs[str(i)] for i in range(3)] == [hf_greedy(target, p, 10) for p in prompts]
