"""Every family in docs/model_families.md: engine greedy output == HF's own greedy `generate`, token
for token, on a tiny random-weight config of that family, for batched prompts of 1-150 tokens at
draft lengths 0, 2 and 4 (the draft a perturbed copy of the target), on the path (fused layers or
HF's modules) the table says. Families or features the engine cannot run exactly must be refused when
the model is built, before anything is served."""

import pytest
import torch

from transformers import AutoConfig

from lanes.engine.core import EngineConfig, build_runner
from lanes.model.attention import PoolAttentionMeta, pool_attention_forward
from lanes.model.families import UnsupportedModelError, check_supported
from lanes.model.fused_decoder import supports
from lanes.model.loader import build_random_model, load_model
from lanes.sample.params import SamplingParams
from tests.conftest import perturbed_copy
from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion, small_engine

VOCAB = 128
MAX_NEW = 16
WINDOW = 24  # sliding window, in tokens: shorter than most prompts, so it matters from the first chunk
_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=1024, initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None)
_ALTERNATING = ["sliding_attention", "full_attention"]
_GEMMA3_TEXT = dict(_SMALL, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                    layer_types=_ALTERNATING, tie_word_embeddings=False)

FAMILIES = {
    # Llama-3: GQA, llama3 rope scaling, tied embeddings, a head_dim other than hidden / heads.
    "llama3": dict(_SMALL, model_type="llama", num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                   rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=64)),
    "qwen2": dict(_SMALL, model_type="qwen2", num_key_value_heads=2),  # q/k/v biases
    # Layers from max_window_layers on slide: layer 0 attends to everything, layer 1 to a window.
    "qwen2_window": dict(_SMALL, model_type="qwen2", num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(_SMALL, model_type="qwen3", num_key_value_heads=2, head_dim=16),  # q/k norms
    "mistral": dict(_SMALL, model_type="mistral", num_key_value_heads=2, sliding_window=None),
    "mistral_window": dict(_SMALL, model_type="mistral", num_key_value_heads=2, sliding_window=WINDOW),
    # Soft-capped attention and logits, query_pre_attn_scalar, sandwich norms, sliding + full layers.
    "gemma2": dict(_SMALL, model_type="gemma2", num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=WINDOW, layer_types=_ALTERNATING, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, tie_word_embeddings=False),
    # q/k norms, a local rope base on sliding layers.
    "gemma3": dict(_GEMMA3_TEXT, model_type="gemma3_text"),
    # Gemma-3 as its checkpoints ship it: the text model inside the image-text model (a tiny vision
    # tower that no test prompt reaches).
    "gemma3_multimodal": dict(model_type="gemma3", text_config=dict(_GEMMA3_TEXT, model_type="gemma3_text"),
                              vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=2, image_size=28,
                                                 patch_size=14),
                              mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2,
                              eoi_token_index=VOCAB - 3, tie_word_embeddings=False),
    "phi3": dict(_SMALL, model_type="phi3", num_key_value_heads=2),  # fused qkv and gate_up projections
    # Partial rotary (a quarter of each head), parallel residual, LayerNorm, biases, no GQA.
    "gpt_neox": dict(_SMALL, model_type="gpt_neox", rotary_pct=0.25, use_parallel_residual=True),
}

FAMILIES["gemma2_hf_modules"] = FAMILIES["gemma2"]  # a fused family run on HF's modules (FORCED_HF_MODULES)

# The rows that take the fused path; the rest run HF's decoder modules over the pool (docs/model_families.md).
FUSED = {"llama3", "qwen2", "qwen2_window", "qwen3", "mistral", "mistral_window", "gemma2", "gemma3",
         "gemma3_multimodal"}
# Rows of a fused family run with EngineConfig.fused_layers=False, so that HF's modules stay tested on
# sliding windows and soft-capping.
FORCED_HF_MODULES = {"gemma2_hf_modules"}


def _fused_layers(name: str) -> bool | None:
    return False if name in FORCED_HF_MODULES else None


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(target, draft, prompts, HF greedy references) of one family, the references taken with eager
    attention (HF's SDPA path drops Gemma-2's attention soft-capping)."""
    target = build_random_model(FAMILIES[request.param], dtype="float64", seed=1)
    draft = perturbed_copy(target, 0.3, seed=2)
    # Lengths 1..150, spread, so rows sit at different lengths in every batch and long ones take
    # several prefill chunks.
    prompts = [[5]] + random_prompts(6, VOCAB, 2, 150, seed=11)
    target.model.set_attn_implementation("eager")
    refs = [hf_greedy(target, p, MAX_NEW) for p in prompts]
    with torch.no_grad():
        logits = target.model(torch.tensor([prompts[-1]])).logits[0].float()  # [T, V]
    return request.param, target, draft, prompts, refs, logits


def test_runner_logits_equal_hf_logits(family):
    """Greedy equality cannot see a monotone transform of the logits (Gemma-2's final soft-cap) but
    sampling can: the runner's logits must be HF's, for a whole prompt from position 0 (the maskless
    path) and then for its tail written after the head (the masked path)."""
    name, target, _, prompts, _, hf_logits = family
    assert supports(target.model) == (name in FUSED | FORCED_HF_MODULES), f"{name}: supports() disagrees with the table"
    prompt, split = torch.tensor([prompts[-1]]), 100
    runner = build_runner(target.model, EngineConfig(max_model_len=320, max_num_seqs=2,
                                                     fused_layers=_fused_layers(name)))
    assert (runner.fused is not None) == (name in FUSED), f"{name} takes the path the table does not say"
    slot = runner.pool.allocate()
    runner.pool.reserve([slot], [prompt.shape[1]])
    whole = runner.forward(runner.rows([slot], [0]), prompt)[0]  # [T, V]
    tail = runner.forward(runner.rows([slot], [split]), prompt[:, split:])[0]
    # float64 models, float32 logits; HF's eager attention takes its softmax in float32.
    torch.testing.assert_close(whole, hf_logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(tail, hf_logits[split:], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("draft_len", [0, 2, 4])
def test_engine_greedy_equals_hf_greedy(family, draft_len):
    name, target, draft, prompts, refs, _ = family
    engine = small_engine(target, draft, num_speculative_tokens=draft_len, fused_layers=_fused_layers(name))
    for runner in (engine.verifier.lane.runner, engine.draft):
        assert (runner.fused is not None) == (name in FUSED), f"{name} takes the path the table does not say"
    requests = {str(i): (p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for i, p in enumerate(prompts)}
    outputs = run_to_completion(engine, requests)
    for i, ref in enumerate(refs):
        assert outputs[str(i)] == ref, f"{name}: prompt {i} (len {len(prompts[i])}) diverged at L={draft_len}"
    stats = engine.total_stats
    if draft_len:
        # The draft must both hit and miss, or rollback went untested.
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, (name, stats.acceptance_rate)


@pytest.mark.parametrize("name", ["gemma2", "gemma2_hf_modules", "gemma3", "mistral_window"])
def test_engine_with_the_kernel_equals_hf_greedy(name):
    """The in-place Triton kernel (on CPU under TRITON_INTERPRET) honours sliding windows and
    soft-capping too, on either path; the fused rows run every fused-layer kernel (Gemma's norm and
    GELU included) too. float32, as the kernel has no float64 dot."""
    target = build_random_model(FAMILIES[name], dtype="float32", seed=1)
    draft = perturbed_copy(target, 0.3, seed=2)
    prompts = random_prompts(3, VOCAB, 30, 70, seed=5)  # past the window before the first output token
    target.model.set_attn_implementation("eager")
    refs = [hf_greedy(target, p, 8) for p in prompts]
    engine = small_engine(target, draft, attention_kernel=True, num_speculative_tokens=3,
                          fused_layers=_fused_layers(name))
    assert (engine.verifier.lane.runner.fused is not None) == (name in FUSED)
    outputs = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=8, ignore_eos=True))
                                         for i, p in enumerate(prompts)})
    assert [outputs[str(i)] for i in range(len(prompts))] == refs
    assert engine.total_stats.num_accepted_tokens > 0


def _longrope_phi3(original: int) -> AutoConfig:
    half_rotary = 8  # head_dim 16 / 2
    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * half_rotary,
                long_factor=[2.0] * half_rotary, original_max_position_embeddings=original)
    return AutoConfig.for_model(**dict(FAMILIES["phi3"], rope_parameters=rope, original_max_position_embeddings=original))


def test_batch_dependent_rope_is_refused_before_any_weight_loads(tmp_path):
    """Phi-3-128k's longrope switches frequencies on the batch's longest position: refused when a
    slot can pass the switch point. The directory holds no weights, so the error can only come from
    the config check that runs first."""
    _longrope_phi3(original=64).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"rope_type='longrope'.*past 64 positions.*holds 1024"):
        load_model(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="holds 65"):
        check_supported(_longrope_phi3(original=64), max_positions=65)
    check_supported(_longrope_phi3(original=64), max_positions=64)  # every position below the switch: exact


def test_engine_refuses_what_it_would_run_inexactly_when_built():
    """A model built outside load_model is checked again when the engine builds its runner."""
    target = build_random_model(FAMILIES["phi3"], dtype="float32")
    target.model.config.rope_parameters = _longrope_phi3(original=64).rope_parameters
    with pytest.raises(UnsupportedModelError, match="longrope"):
        small_engine(target, None)


@pytest.mark.parametrize(("config", "feature"), [
    (dict(model_type="bloom"), "AttentionInterface"),  # ALiBi, computed in Bloom's own attention
    (dict(model_type="gpt_oss"), "attention sinks"),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention=True"),
])
def test_families_the_pool_cannot_run_are_refused_by_name(tmp_path, config, feature):
    AutoConfig.for_model(**config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=feature):
        load_model(str(tmp_path))


def test_an_attention_term_the_pool_does_not_compute_is_never_dropped():
    """Belt and braces for a family that passed the config check: attention sinks reaching the pool
    attention raise instead of being ignored."""
    query, pool = torch.zeros(1, 2, 1, 16), torch.zeros(2, 2, 8, 16)
    meta = PoolAttentionMeta(torch.tensor([0]), torch.tensor([0], dtype=torch.int32), 1, None, 1, False,
                             torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="s_aux"):
        pool_attention_forward(torch.nn.Identity(), query, pool, pool, None, pool_meta=meta, s_aux=torch.zeros(2))
