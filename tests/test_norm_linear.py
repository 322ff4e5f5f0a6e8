"""lanes/model/norm_linear.py under Triton's CPU interpreter (tests/conftest.py): the norm and the linear after
it (and the SiLU-and-multiply) as one kernel, against the separate norm, F.linear and activation; and an
engine whose draft and target decode through it, greedy equal to HF's."""

import pytest
import torch
import torch.nn.functional as F

from lanes.model import fused_decoder
from lanes.model.fused_ops import add_rms_norm, silu_and_mul
from lanes.model.norm_linear import MAX_ROWS, fits, norm_linear, tile
from lanes.sample.params import SamplingParams
from tests.conftest import VOCAB, make_pair
from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion, small_engine

# float32 checks the arithmetic: summed in another order than the reference's GEMM, nothing else differs.
# bfloat16 checks where values are rounded, loosely: the interpreter truncates where a GPU rounds, at each
# of up to six roundings here (sum, normalised value, its product with the weight, gate, SiLU, product).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-4, atol=2e-2)}


def _reference(x, residual, norm_w, eps, weight, bias, act):
    normed, stream = add_rms_norm(x, residual, norm_w, eps, use_triton=False)  # HF's arithmetic
    out = F.linear(normed.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return (silu_and_mul(out, use_triton=False) if act else out), stream


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "residual", "bias", "act"), [
    (1, True, False, False), (1, True, False, True), (1, False, True, False), (2, True, True, True),
    (3, True, False, True), (4, False, False, False)])
def test_norm_linear_equals_the_norm_then_the_linear(rows, residual, bias, act, dtype):
    """Every padded row count (1, 2, 4), a first layer's (no residual) and a later one's, a bias (Qwen2's qkv),
    with and without the activation; K spans more than one BLOCK_K (two loops over it), N is no multiple of
    BLOCK_N (masked columns)."""
    k, n = 600, 44
    gen = torch.Generator().manual_seed(rows * 10 + residual + 2 * bias + 4 * act)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    res = torch.randn(rows, k, generator=gen).to(dtype) if residual else None
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    weight = (torch.randn(2 * n if act else n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(weight.shape[0], generator=gen).to(dtype) if bias else None
    assert k > tile(rows, act)[2] and n % tile(rows, act)[1]
    out, stream = norm_linear(x, res, norm_w, 1e-5, weight, b, silu_and_mul=act)
    ref_out, ref_stream = _reference(x, res, norm_w, 1e-5, weight, b, act)
    assert out.shape == (rows, n) and out.dtype == dtype
    torch.testing.assert_close(stream, ref_stream, **TOL[dtype])
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    if not residual:
        assert stream is x  # the first layer's stream is its input, not a copy


def test_fits_few_contiguous_rows_of_the_weights_dtype():
    w = torch.randn(16, 32)
    assert fits(torch.randn(MAX_ROWS, 32), w) and not fits(torch.randn(MAX_ROWS + 1, 32), w)
    assert not fits(torch.randn(32, 2).T, w)  # a non-contiguous input
    assert not fits(torch.randn(1, 32, dtype=torch.float64), w.double())  # no float64 path
    assert [tile(r, False)[0] for r in (1, 2, 3, 4)] == [1, 2, 4, 4]  # one compile per padded count


def test_engine_through_the_fused_kernel_decodes_greedy_equal_to_hf(monkeypatch):
    """Both models' decode and draft forwards (batch <= 4) through the kernel, float32 (Triton has no
    float64 dot): speculative greedy output equal to HF's, with drafts both accepted and rejected."""
    calls = []
    original = fused_decoder.norm_linear
    monkeypatch.setattr(fused_decoder, "norm_linear", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    target, draft = make_pair("llama", dtype="float32")
    prompts = random_prompts(2, VOCAB, 2, 20, seed=5)
    engine = small_engine(target, draft, attention_kernel=True, fused_norm_linear=True, num_speculative_tokens=3)
    outputs = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=8, ignore_eos=True))
                                         for i, p in enumerate(prompts)})
    assert [outputs[str(i)] for i in range(2)] == [hf_greedy(target, p, 8) for p in prompts]
    stats = engine.total_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert calls  # the fused path ran (its forwards are the few-row ones)


def test_off_by_config_and_on_the_cpu_by_default():
    target, draft = make_pair("llama", dtype="float32")
    assert not small_engine(target, draft, attention_kernel=True).draft.fused.fuse_norm_linear  # None: CUDA only
    assert small_engine(target, draft, attention_kernel=True, fused_norm_linear=True).draft.fused.fuse_norm_linear
