"""Which model families the engine runs exactly, decided from the config alone (before any weight loads).

The engine runs HF's own decoder modules over its KV pool (lanes/model/pool_cache.py, lanes/model/attention.py),
or its fused layers for Llama-family and Gemma-2/3 models (lanes/model/fused_decoder.py). That is exact when every
attention call goes through HF's AttentionInterface with features the pool attention implements
(causal, sliding window, soft-capping) and when a token's rotary table depends on its position only.
Anything else is refused here with the feature and the config value that triggered it: a config the
engine cannot run exactly must fail at load, never serve different tokens. docs/model_families.md
lists the families tested.
"""

from transformers import AutoModelForCausalLM, PretrainedConfig

# Rotary types whose frequencies HF switches on the longest position in the forward's batch: one long
# row (or a padding row past its length) would change every other row's rotation.
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Families whose attention has a term the pool attention does not compute.
REFUSED_TYPES = {"gpt_oss": "attention sinks (per-head sink logits, `s_aux`)"}


class UnsupportedModelError(ValueError):
    """The engine cannot run this model exactly."""


def check_supported(config: PretrainedConfig, max_positions: int | None = None) -> None:
    """Refuse a config the engine would run inexactly. `max_positions`: the most positions a KV slot
    holds (EngineConfig.slot_capacity_tokens; None: the config's max_position_embeddings)."""
    text = config.get_text_config()
    if text.model_type in REFUSED_TYPES:
        raise UnsupportedModelError(f"{text.model_type}: {REFUSED_TYPES[text.model_type]} are not supported")
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if model_class is not None and not getattr(model_class, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{config.model_type}: {model_class.__name__} does not route attention through HF's AttentionInterface "
            "(e.g. ALiBi or custom attention), so the KV pool cannot serve it")
    if getattr(text, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"{text.model_type}: use_bidirectional_attention=True is not causal decoding")
    positions = max_positions or text.max_position_embeddings
    for rope in rope_parameter_sets(text):
        _check_rope(text, rope, positions)


def rope_parameter_sets(text: PretrainedConfig) -> list[dict]:
    """The rotary parameters of each layer type (Gemma-3 keys them by layer type)."""
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    return [rope]


def _check_rope(text: PretrainedConfig, rope: dict, positions: int) -> None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in BATCH_DEPENDENT_ROPE:
        return
    # The position past which HF switches frequencies (its `original_max_seq_len` for each type).
    if rope_type == "longrope":
        switch = rope.get("original_max_position_embeddings") or text.original_max_position_embeddings
    else:
        switch = text.max_position_embeddings
    if positions > switch:
        raise UnsupportedModelError(
            f"{text.model_type}: rope_type={rope_type!r} changes its frequencies with the longest sequence in a "
            f"batch past {switch} positions, and a KV slot here holds {positions}; lower max_model_len (a slot "
            f"holds it plus room for one draft) to fit {switch}")
