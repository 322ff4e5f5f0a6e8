"""Weight-only int8 drafts (lanes/model/int8_linear.py, `draft.quantization: int8`).

The kernel runs under Triton's interpreter here (tests/conftest.py sets TRITON_INTERPRET). What the lossless
contract needs of a quantized draft: its forward is exactly a model's (the weights it dequantizes to), so the
probabilities it drafts from are the ones rejection sampling divides by; and greedy output stays the target's.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from deployments.config import DraftModelSpec
from lanes.engine.core import EngineConfig, build_runner
from lanes.model.int8_linear import MAX_KERNEL_ROWS, Int8Weight, int8_linear, quantize
from lanes.model.loader import LoadedModel
from lanes.sample.params import SamplingParams
from tests.conftest import make_pair
from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion, small_engine


@pytest.fixture(scope="module")
def float32_pair() -> tuple[LoadedModel, LoadedModel]:
    return make_pair("llama", dtype="float32")  # the kernel's dtypes: float32, bfloat16, float16


def test_quantize_keeps_every_weight_within_half_a_step_of_its_row():
    weight = torch.randn(48, 72, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 48)[:, None]
    q = quantize(weight)
    assert q.q.dtype == torch.int8 and q.scale.dtype == torch.float32 and q.dequantize().dtype == weight.dtype
    assert (q.q.abs().amax(dim=1) == 127).all()  # each row's largest magnitude is the top of the range
    assert ((q.dequantize() - weight).abs() <= q.scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("rows", [1, 3, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_equals_the_dequantized_linear(rows, dtype, with_bias):
    """One row: the reduction path; up to MAX_KERNEL_ROWS: tensor-core tiles; past it: the dequantized weight
    through F.linear. N and K are not multiples of any tile."""
    gen = torch.Generator().manual_seed(rows)
    weight = quantize(torch.randn(72, 88, generator=gen))
    x = torch.randn(rows, 88, generator=gen).to(dtype)
    bias = torch.randn(72, generator=gen).to(dtype) if with_bias else None
    out = int8_linear(x, weight, bias)
    expected = F.linear(x.float(), weight.dequantize().float(), None if bias is None else bias.float())
    assert out.shape == (rows, 72) and out.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-1)  # bf16 outputs of ~10
    torch.testing.assert_close(out.float(), expected, **tol)


def test_a_batch_of_rows_in_three_dimensions_keeps_its_shape():
    weight = quantize(torch.randn(40, 24))
    x = torch.randn(2, 3, 24)
    torch.testing.assert_close(int8_linear(x, weight), x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)


def _dequantized_copy(model: LoadedModel) -> LoadedModel:
    """The model an int8 draft runs: every decoder linear and the LM head replaced by its dequantized weight."""
    dense = copy.deepcopy(model.model)
    with torch.no_grad():
        for name, module in dense.named_modules():
            if isinstance(module, torch.nn.Linear) and ("layers." in name or module is dense.get_output_embeddings()):
                module.weight.copy_(quantize(module.weight).dequantize())
    return LoadedModel(dense, model.tokenizer, f"{model.name}-dequantized")


def test_an_int8_draft_runner_is_one_model_in_every_forward(float32_pair):
    """Forwards of up to MAX_KERNEL_ROWS (the kernel) give the logits of the model whose weights are the
    dequantized ones, and a prompt of more rows (cuBLAS on the weights as loaded) the draft's own: the
    probabilities a draft is sampled from and divided by in rejection sampling are one model's."""
    _, draft = float32_pair
    config = EngineConfig(max_model_len=320, max_num_seqs=2, draft_quantization="int8")
    runner = build_runner(draft.model, config, draft=True)
    layer = runner.fused.layers[0]
    assert isinstance(layer.qkv_w, Int8Weight) and isinstance(layer.down_w, Int8Weight)
    assert runner.head_int8 is not None
    prompt = torch.tensor([random_prompts(1, 128, 80, 80, seed=3)[0]])
    small, large = runner.pool.allocate(), runner.pool.allocate()
    runner.pool.reserve([small, large], [20, 80])
    head = runner.forward(runner.rows([small], [0]), prompt[:, :16], prefill=True)[0]  # 16 rows
    tail = runner.forward(runner.rows([small], [16]), prompt[:, 16:20])[0]  # 4 rows, after them
    whole = runner.forward(runner.rows([large], [0]), prompt, prefill=True)[0]  # 80 rows
    with torch.no_grad():
        dequantized = _dequantized_copy(draft).model(prompt[:, :20]).logits[0].float()
        loaded = draft.model(prompt).logits[0].float()
    torch.testing.assert_close(torch.cat([head, tail]), dequantized, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(whole, loaded, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(dequantized, loaded[:20], rtol=1e-4, atol=1e-4)  # the quantization is not a no-op


def test_greedy_output_with_an_int8_draft_is_the_targets(float32_pair):
    target, draft = float32_pair
    engine = small_engine(target, draft, num_speculative_tokens=4, draft_quantization="int8")
    assert engine.draft.head_int8 is not None and engine.draft.fused.linear is not F.linear
    prompts = random_prompts(3, 128, 4, 24, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(target, prompt, 12), f"prompt {i}"
    assert engine.total_stats.num_accepted_tokens > 0  # a close draft, quantized, still agrees


def test_the_config_names_what_is_not_supported():
    with pytest.raises(ValueError, match="draft_quantization"):
        EngineConfig(draft_quantization="int4")
    with pytest.raises(ValidationError, match="tensor_parallel_size 1"):
        DraftModelSpec(path="models/vpd-draft", quantization="int8", tensor_parallel_size=2)
    assert DraftModelSpec(path="models/vpd-draft", quantization="int8").quantization == "int8"


def test_past_the_kernels_rows_the_weight_as_loaded_runs_where_it_is_kept():
    gen = torch.Generator().manual_seed(5)
    dense = torch.randn(40, 24, generator=gen)
    x = torch.randn(MAX_KERNEL_ROWS + 1, 24, generator=gen)
    assert torch.equal(int8_linear(x, quantize(dense, keep_dense=True)), F.linear(x, dense))
    torch.testing.assert_close(int8_linear(x, quantize(dense)), F.linear(x, quantize(dense).dequantize()))
