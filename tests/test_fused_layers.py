"""The fused layers (Llama family, Gemma-2/3): each Triton kernel (run by Triton's interpreter) against
the torch path and HF's modules, the whole decoder against HF's hidden states, and the HF path kept
working."""

import pytest
import torch

from lanes.kv.pool import KVPool, PoolShape
from lanes.model.fused_decoder import FusedDecoder, supports, unsupported_reason
from lanes.model.fused_ops import add_gemma_rms_norm, add_rms_norm, gelu_tanh_and_mul, rope_store, silu_and_mul
from lanes.model.loader import build_random_model
from lanes.sample.params import SamplingParams
from tests.conftest import ARCH_CONFIGS, VOCAB
from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion, small_engine
from tests.paged_helpers import paginate


def _dense(blocks: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """blocks [n, kv_heads, block_size, D] through table [slots, per_slot] -> [slots, kv_heads, per_slot * block_size, D]."""
    gathered = blocks[table.long()]  # [slots, per_slot, kv_heads, block_size, D]
    slots, per_slot, heads, size, dim = gathered.shape
    return gathered.transpose(1, 2).reshape(slots, heads, per_slot * size, dim)

# Triton's CPU interpreter truncates to bf16 where the GPU rounds to nearest: allow two bf16 ulps
# (two roundings) for kernels run here; float32 must agree to float32 precision.
KERNEL_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-6, atol=1e-5)}


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_hf_rounding(with_residual, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(5, 96, generator=gen).to(dtype) for _ in range(2))
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    summed = res + x if with_residual else x
    residual = res if with_residual else None
    for use_triton in (False, True):
        out, new_res = add_rms_norm(x, residual, norm.weight, 1e-5, use_triton)
        # the torch path is HF's exact arithmetic
        tol = KERNEL_TOL[dtype] if use_triton else dict(rtol=0, atol=0)
        torch.testing.assert_close(new_res, summed, **tol)
        torch.testing.assert_close(out, norm(new_res), **tol)  # the norm of the stream it returned


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_gemma_rms_norm_matches_hf_gemma_norms(with_residual, dtype):
    """Gemma's norm scales by (1 + w) in float32 and rounds once (Llama's rounds before the weight):
    the same in Gemma-2's and Gemma-3's modules."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(5)
    x, res = (torch.randn(5, 96, generator=gen).to(dtype) for _ in range(2))
    weight = (0.3 * torch.randn(96, generator=gen)).to(dtype)
    summed = res + x if with_residual else x
    residual = res if with_residual else None
    for norm_type in (Gemma2RMSNorm, Gemma3RMSNorm):
        norm = norm_type(96, eps=1e-6).to(dtype)
        norm.weight.data = weight
        for use_triton in (False, True):
            out, new_res = add_gemma_rms_norm(x, residual, norm.weight, 1e-6, use_triton)
            tol = KERNEL_TOL[dtype] if use_triton else dict(rtol=0, atol=0)
            torch.testing.assert_close(new_res, summed, **tol)
            torch.testing.assert_close(out, norm(new_res), **tol)
    # Not Llama's rounding: the two norms differ wherever bf16 rounds (the test would pass either way otherwise).
    if dtype == torch.bfloat16:
        llama, _ = add_rms_norm(x, residual, 1 + weight, 1e-6, False)
        assert not torch.equal(llama, add_gemma_rms_norm(x, residual, weight, 1e-6, False)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_kernel_matches_hf_gemma_activation(dtype):
    from transformers.activations import ACT2FN

    gate_up = (3 * torch.randn(7, 2 * 300, generator=torch.Generator().manual_seed(6))).to(dtype)
    ref = ACT2FN["gelu_pytorch_tanh"](gate_up[:, :300]) * gate_up[:, 300:]
    assert torch.equal(gelu_tanh_and_mul(gate_up, False), ref)
    torch.testing.assert_close(gelu_tanh_and_mul(gate_up, True), ref, **KERNEL_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_kernel_matches_hf_mlp_activation(dtype):
    gate_up = torch.randn(7, 2 * 300, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = torch.nn.functional.silu(gate_up[:, :300]) * gate_up[:, 300:]
    assert torch.equal(silu_and_mul(gate_up, False), ref)
    torch.testing.assert_close(silu_and_mul(gate_up, True), ref, **KERNEL_TOL[dtype])


@pytest.mark.parametrize("block_size", [16, 3])
def test_rope_store_kernel_matches_torch_path_and_writes_only_the_new_positions(block_size):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(2)
    q_heads, kv_heads, dim, batch, q_len, capacity = 4, 2, 16, 3, 5, 40
    qkv = torch.randn(batch, q_len, (q_heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.rand(capacity, dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    slot_ids, starts = torch.tensor([3, 0, 1]), torch.tensor([0, 7, 30], dtype=torch.int32)
    pools = {}
    for use_triton in (False, True):
        zeros, table = paginate(torch.zeros(5, kv_heads, capacity, dim), block_size, seed=3)
        k_blocks, v_blocks = zeros.zero_(), zeros.clone()
        query = rope_store(qkv, cos, sin, table, slot_ids, starts, k_blocks, v_blocks, q_heads, use_triton)
        pools[use_triton] = (query, _dense(k_blocks, table), _dense(v_blocks, table))
    for got, want in zip(pools[True], pools[False]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    query, k_pool, v_pool = pools[False]
    # Against HF's rotary on row 1 (positions 7..11).
    heads = qkv[1].view(q_len, q_heads + 2 * kv_heads, dim)
    positions = torch.arange(7, 12)
    full_cos = torch.cat((cos[positions], cos[positions]), -1)[None]
    full_sin = torch.cat((sin[positions], sin[positions]), -1)[None]
    q_ref, k_ref = apply_rotary_pos_emb(heads[None, :, :q_heads].transpose(1, 2),
                                        heads[None, :, q_heads:q_heads + kv_heads].transpose(1, 2), full_cos, full_sin)
    torch.testing.assert_close(query[1], q_ref[0].transpose(0, 1))
    torch.testing.assert_close(k_pool[0, :, 7:12], k_ref[0])
    torch.testing.assert_close(v_pool[0, :, 7:12], heads[:, q_heads + kv_heads:].transpose(0, 1))
    written = torch.zeros(5, k_pool.shape[2], dtype=torch.bool)
    for slot, start in zip(slot_ids.tolist(), starts.tolist()):
        written[slot, start:start + q_len] = True
    assert (k_pool.abs().sum((1, 3)) > 0).eq(written).all()


_GEMMA = dict(ARCH_CONFIGS["llama"], head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False)
CONFIGS = {
    **ARCH_CONFIGS,
    # Qwen3: per-head q/k RMSNorms before the rotary, and a head_dim other than hidden / heads.
    "qwen3": dict(ARCH_CONFIGS["qwen2"], model_type="qwen3", head_dim=32),
    # Sandwich (1 + w) norms, GELU, query_pre_attn_scalar, a window of 4 on layers 0 and 2; Gemma-2
    # soft-caps its scores, Gemma-3 norms q/k heads and rotates sliding layers with a local base.
    "gemma2": dict(_GEMMA, model_type="gemma2", attn_logit_softcapping=2.0),
    "gemma3": dict(_GEMMA, model_type="gemma3_text"),
}


@pytest.mark.parametrize(("arch", "use_triton"), [("llama", False), ("qwen2", False), ("qwen3", False),
                                                  ("qwen3", True), ("gemma2", False), ("gemma2", True),
                                                  ("gemma3", False), ("gemma3", True)])
def test_fused_decoder_equals_hf_hidden_states_and_shares_the_weights(arch, use_triton):
    model = build_random_model(CONFIGS[arch], dtype="float64", seed=3).model
    if arch == "gemma2":  # HF's SDPA path drops Gemma-2's soft-cap; its eager softmax runs in float32
        model.set_attn_implementation("eager")
    assert supports(model)
    bytes_before = sum(p.numel() * p.element_size() for p in model.parameters())
    pool = KVPool(PoolShape.for_model(model.config, 2, 64, block_size=3), model.dtype, "cpu")
    pool.reserve([pool.allocate(), pool.allocate()], [9, 9])
    pool.sync_block_table()
    decoder = FusedDecoder(model, pool, use_triton=use_triton)  # Triton: its CPU interpreter here
    attn = model.get_decoder().layers[0].self_attn
    qkv = decoder.layers[0].qkv_w
    assert attn.k_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == bytes_before
    from lanes.model.attention import PoolAttentionMeta

    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(9).expand(2, 9)
    mask = torch.where(torch.arange(64)[None, None] <= positions[:, :, None], 0.0, float("-inf")).double()[:, None]
    meta = PoolAttentionMeta(torch.tensor([0, 1]), torch.zeros(2, dtype=torch.int32), 64, mask, 1, False,
                             pool.block_table_device)
    with torch.inference_mode():
        ref = model.get_decoder()(input_ids=ids).last_hidden_state
        # The Triton kernels compute in float32 whatever the model's dtype, as does HF's eager softmax:
        # float32's tolerance there.
        float32 = use_triton or arch == "gemma2"
        torch.testing.assert_close(decoder(ids, meta), ref, **(dict(rtol=1e-4, atol=1e-5) if float32 else {}))


def test_unsupported_architectures_keep_the_hf_modules():
    gpt2 = build_random_model(dict(model_type="gpt2", vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).model
    assert not supports(gpt2)
    windowed = dict(CONFIGS["qwen3"], use_sliding_window=True, sliding_window=16)  # a window not tested fused
    assert unsupported_reason(build_random_model(windowed).model) == "sliding_window=16"
    erf_gelu = build_random_model(dict(CONFIGS["gemma2"], hidden_activation="gelu")).model  # exact GELU, not tanh
    assert unsupported_reason(erf_gelu) == "hidden_activation='gelu'"
    # Each family takes the activation it is tested with only: a Llama with Gemma's GELU stays on HF's modules.
    gelu_llama = build_random_model(dict(ARCH_CONFIGS["llama"], hidden_act="gelu_pytorch_tanh")).model
    assert unsupported_reason(gelu_llama) == "hidden_act='gelu_pytorch_tanh'"
    assert supports(build_random_model({**ARCH_CONFIGS["qwen2"], "use_sliding_window": True,
                                        "sliding_window": 16}).model)


def test_hf_module_path_still_decodes_greedy_equal(llama_pair):
    target, draft = llama_pair
    prompts = random_prompts(4, VOCAB, 2, 60, seed=21)
    engine = small_engine(target, draft, fused_layers=False, num_speculative_tokens=3)
    assert engine.draft.fused is None
    outputs = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=12, ignore_eos=True))
                                         for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(target, p, 12)
