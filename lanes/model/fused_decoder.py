"""The decoder stack of a Llama-family HF model (llama, mistral, qwen2, qwen3) or of Gemma-2 / Gemma-3
(text) run as ten kernels a layer.

Per layer: add + RMSNorm, one QKV GEMM, rotary + KV write, attention (two kernels), o_proj,
add + RMSNorm, one gate/up GEMM, SiLU-and-multiply, down_proj. HF's eager layer launches ~45.
Qwen3 and Gemma-3 add an RMSNorm over each query and key head before the rotary (q_norm / k_norm):
two more norm kernels and a concatenation a layer.
Gemma's layer is the same stack with its own norm ((1 + w) scaling, in float32), a GELU (tanh)
instead of the SiLU, and two more norms, on the attention's and the MLP's outputs before they join
the residual stream ("sandwich" norms): two more kernels a layer.
Sliding-window layers (Mistral, Qwen2 past max_window_layers, Gemma's sliding layers) pass their
window to the pool attention, Gemma-2 its score soft-cap; Gemma-3's sliding layers rotate with their
own (local base) table. Each of these is read from the HF layer, which passes the same values to its
own attention call.
The weights are the HF model's own: Q, K and V (and gate and up) are concatenated once and the HF
parameters become views into the concatenation, so no memory is duplicated and the HF model keeps
working unchanged (reference decoding in tests, `generate`).

Other architectures run the HF modules through PoolCache (lanes/model/runner.py).
"""

import torch
import torch.nn.functional as F

from lanes.kv.pool import KVPool
from lanes.model import int8_linear as int8
from lanes.model.attention import PoolAttentionMeta, attend
from lanes.model.families import rope_parameter_sets
from lanes.model.fused_ops import add_gemma_rms_norm, add_rms_norm, gelu_tanh_and_mul, rope_store, silu_and_mul

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
QK_NORM_TYPES = ("qwen3", "gemma3_text")  # per-head RMSNorm of queries and keys before the rotary
# Gemma: (1 + w) norms, sandwich norms around attention and MLP, `hidden_activation` (not `hidden_act`).
GEMMA_TYPES = ("gemma2", "gemma3_text")
WINDOW_TYPES = ("mistral", "qwen2", "gemma2", "gemma3_text")  # sliding windows tested on the fused path
# Gemma-3's attention module keeps `attn_logit_softcapping` but does not pass it to its attention call.
SOFTCAP_TYPES = ("gemma2",)
# act(gate) * up, as every family above computes its MLP with HF's ACT2FN[activation]. Each family
# takes the activation it is tested with only.
ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # tables that depend on the position only


def supports(model: torch.nn.Module) -> bool:
    """Whether `model` is a Llama-family or Gemma-2/3 decoder this module computes exactly."""
    return unsupported_reason(model) is None


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """What of `model` this module does not compute (None: nothing)."""
    reason = unsupported_config(model.config)
    layers = getattr(model.get_decoder(), "layers", [])
    if reason is None and not layers:
        reason = "no decoder layers"
    if (reason is None and model.config.get_text_config().model_type not in QK_NORM_TYPES
            and any(hasattr(layer.self_attn, "q_norm") for layer in layers)):
        reason = "q/k norms"
    return reason


def unsupported_config(config) -> str | None:
    """What of a model config this module does not compute, read from the config alone (None: nothing)."""
    text = config.get_text_config()
    sliding = sliding_window(text)
    if text.model_type not in SUPPORTED_TYPES:
        return f"model_type={text.model_type!r}"
    if _activation(text) != ("gelu_pytorch_tanh" if text.model_type in GEMMA_TYPES else "silu"):
        return f"{_activation_key(text)}={_activation(text)!r}"
    if sliding and text.model_type not in WINDOW_TYPES:
        return f"sliding_window={sliding}"
    rope_types = [rope.get("rope_type", "default") for rope in rope_parameter_sets(text)]
    dynamic = [rope_type for rope_type in rope_types if rope_type not in STATIC_ROPE]
    return f"rope_type={dynamic[0]!r}" if dynamic else None


def sliding_window(text) -> int | None:
    """The config's sliding window, where its layers use one (Qwen2 keeps a window it does not use)."""
    return getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None


def _activation_key(text) -> str:
    return "hidden_activation" if text.model_type in GEMMA_TYPES else "hidden_act"


def _activation(text) -> str:
    return getattr(text, _activation_key(text))


def _fuse(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the output rows of `modules` and make their parameters views of the result."""
    weight = torch.cat([m.weight.data for m in modules])
    bias = torch.cat([m.bias.data for m in modules]) if modules[0].bias is not None else None
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight.data = weight[start:start + rows]
        if bias is not None:
            m.bias.data = bias[start:start + rows]
        start += rows
    return weight, bias


def _norm(module: torch.nn.Module | None) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of an HF RMSNorm (Llama's names it variance_epsilon, Gemma's eps)."""
    if module is None:
        return None
    return module.weight, module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps


class _Layer:
    def __init__(self, layer: torch.nn.Module, text):
        attn, mlp = layer.self_attn, layer.mlp
        # A second runner over the same model reuses the concatenation, unless the parameters were
        # replaced since (`model.float()`, `.to(...)`) and no longer view it.
        fused = getattr(layer, "_vpd_fused", None)
        if fused is None or fused[0][0].data_ptr() != attn.q_proj.weight.data_ptr():
            fused = layer._vpd_fused = (_fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
                                        _fuse([mlp.gate_proj, mlp.up_proj]))
        (self.qkv_w, self.qkv_b), (self.gate_up_w, self.gate_up_b) = fused
        self.o_w, self.o_b = attn.o_proj.weight, attn.o_proj.bias
        self.down_w, self.down_b = mlp.down_proj.weight, mlp.down_proj.bias
        self.in_norm = _norm(layer.input_layernorm)
        # Llama: the norm before the MLP. Gemma: the norm of the attention's output, and the MLP has its own two.
        self.post_norm = _norm(layer.post_attention_layernorm)
        self.pre_mlp_norm = _norm(getattr(layer, "pre_feedforward_layernorm", None))
        self.post_mlp_norm = _norm(getattr(layer, "post_feedforward_layernorm", None))
        self.q_heads = attn.q_proj.weight.shape[0] // attn.head_dim
        self.head_dim = attn.head_dim
        q_norm = _norm(getattr(attn, "q_norm", None))
        self.qk_norm = None if q_norm is None else (q_norm, _norm(attn.k_norm))
        self.scale = attn.scaling
        self.layer_idx = attn.layer_idx
        # What HF's attention call of this layer passes: Mistral reads its window from the config,
        # the others keep it per layer (None on full-attention layers).
        self.window = (sliding_window(text) if text.model_type == "mistral"
                       else getattr(attn, "sliding_window", None))
        self.softcap = attn.attn_logit_softcapping if text.model_type in SOFTCAP_TYPES else None
        self.layer_type = getattr(attn, "layer_type", None)  # picks Gemma-3's rotary table
        self.cos = self.sin = None  # set by FusedDecoder: [positions, D/2] each


def _first_half(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = cos.shape[-1] // 2
    return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()


def _int8(weight: torch.Tensor) -> int8.Int8Weight:
    return int8.quantize(weight, keep_dense=True)


class FusedDecoder:
    def __init__(self, model: torch.nn.Module, pool: KVPool, use_triton: bool, row_linear=F.linear):
        """`row_linear`: how o_proj and down_proj are applied, F.linear itself or, over the shards of a
        tensor-parallel model, F.linear followed by the all-reduce (lanes/parallel/tensor_parallel.py).
        `quantize_int8()` switches every linear to int8 weights afterwards."""
        decoder = model.get_decoder()
        text = model.config.get_text_config()
        gemma = text.model_type in GEMMA_TYPES
        # Gemma's embedding module scales by sqrt(hidden) itself, in the model dtype.
        self.embed = decoder.embed_tokens
        self.layers = [_Layer(layer, text) for layer in decoder.layers]
        self.norm = _norm(decoder.norm)
        self.add_norm = add_gemma_rms_norm if gemma else add_rms_norm
        self.act_and_mul = ACTIVATIONS[_activation(text)]
        self.layer_step = self._sandwich_layer if gemma else self._pre_norm_layer
        self.pool = pool
        self.use_triton = use_triton
        self.linear = F.linear
        self.row_linear = row_linear
        tables = self._rope_tables(decoder, pool.shape.capacity_tokens)
        for layer in self.layers:
            layer.cos, layer.sin = tables[layer.layer_type if layer.layer_type in tables else None]

    def quantize_int8(self) -> None:
        """Every layer's linears as int8 weights (lanes/model/int8_linear.py): the draft's option. The
        weights as loaded stay, for forwards of many rows (prompts), where cuBLAS runs them."""
        if self.row_linear is not F.linear:
            raise ValueError("int8 weights and tensor parallelism do not combine (draft.quantization)")
        for layer in self.layers:
            layer.qkv_w, layer.o_w = _int8(layer.qkv_w), _int8(layer.o_w)
            layer.gate_up_w, layer.down_w = _int8(layer.gate_up_w), _int8(layer.down_w)
        self.linear = self.row_linear = int8.int8_linear  # every linear is int8 now

    @staticmethod
    def _rope_tables(decoder, positions: int) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """HF's own cos/sin for every position a slot can hold: [positions, D/2] each, model dtype.
        (HF's table is two copies of the half; rotary scaling types are HF's business.) Keyed by layer
        type where HF's rotary module computes one table per type (Gemma-3: a local base frequency for
        sliding layers), else under None."""
        weight = decoder.embed_tokens.weight
        position_ids = torch.arange(positions, device=weight.device)[None]
        rotary = decoder.rotary_emb
        per_type = getattr(rotary, "layer_types", None)
        if per_type is None:
            return {None: _first_half(*rotary(weight[:1], position_ids))}
        return {layer_type: _first_half(*rotary(weight[:1], position_ids, layer_type)) for layer_type in per_type}

    def __call__(self, input_ids: torch.Tensor, meta: PoolAttentionMeta) -> torch.Tensor:
        """input_ids [B, Q] at positions meta.kv_lens[b] + i of slots meta.slot_ids -> hidden [B, Q, H]."""
        batch, q_len = input_ids.shape
        hidden = self.embed(input_ids).view(batch * q_len, -1)  # [T, H]
        residual = None
        for layer in self.layers:
            hidden, residual = self.layer_step(layer, hidden, residual, (batch, q_len), meta)
        out, _ = self.add_norm(hidden, residual, *self.norm, self.use_triton)
        return out.view(batch, q_len, -1)

    def _pre_norm_layer(self, layer: _Layer, hidden: torch.Tensor, residual: torch.Tensor | None,
                        shape: tuple[int, int], meta: PoolAttentionMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """Llama family. hidden [T, H]: the last layer's MLP output, not yet added to `residual` (the
        stream); `shape`: (B, Q) of the T tokens. Returns this layer's (hidden, residual)."""
        normed, residual = add_rms_norm(hidden, residual, *layer.in_norm, self.use_triton)
        attn = self._attention(layer, normed.view(*shape, -1), meta)
        normed, residual = add_rms_norm(self.row_linear(attn, layer.o_w, layer.o_b), residual, *layer.post_norm,
                                        self.use_triton)
        gate_up = self.linear(normed, layer.gate_up_w, layer.gate_up_b)  # [T, 2I]
        return self.row_linear(self.act_and_mul(gate_up, self.use_triton), layer.down_w, layer.down_b), residual

    def _sandwich_layer(self, layer: _Layer, hidden: torch.Tensor, residual: torch.Tensor | None,
                        shape: tuple[int, int], meta: PoolAttentionMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma: as _pre_norm_layer, with the attention's and the MLP's outputs normed before they join
        the stream (HF adds `residual + norm(output)`, which the next add_norm does)."""
        normed, residual = self.add_norm(hidden, residual, *layer.in_norm, self.use_triton)
        attn = self._attention(layer, normed.view(*shape, -1), meta)
        attn, _ = self.add_norm(self.row_linear(attn, layer.o_w, layer.o_b), None, *layer.post_norm, self.use_triton)
        normed, residual = self.add_norm(attn, residual, *layer.pre_mlp_norm, self.use_triton)
        gate_up = self.linear(normed, layer.gate_up_w, layer.gate_up_b)  # [T, 2I]
        mlp = self.row_linear(self.act_and_mul(gate_up, self.use_triton), layer.down_w, layer.down_b)
        return self.add_norm(mlp, None, *layer.post_mlp_norm, self.use_triton)[0], residual

    def _attention(self, layer: _Layer, normed: torch.Tensor, meta: PoolAttentionMeta) -> torch.Tensor:
        batch, q_len, _ = normed.shape
        qkv = self.linear(normed, layer.qkv_w, layer.qkv_b)  # [B, Q, (Hq + 2 Hkv) * D]
        if layer.qk_norm is not None:
            qkv = self._norm_heads(qkv, layer)
        k_pool, v_pool = self.pool.layer(layer.layer_idx)  # [blocks, Hkv, block_size, D]
        query = rope_store(qkv, layer.cos, layer.sin, meta.block_table, meta.slot_ids, meta.kv_lens, k_pool, v_pool,
                           layer.q_heads, self.use_triton)  # [B, Q, Hq, D]
        out = attend(query.transpose(1, 2), k_pool, v_pool, meta, layer.scale, layer.window,
                     layer.softcap)  # [B, Q, Hq, D]
        return out.reshape(batch * q_len, -1)

    def _norm_heads(self, qkv: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """The RMSNorm of every query and key head [D] (Qwen3's and Gemma-3's q_norm / k_norm), values untouched."""
        dim = layer.head_dim
        q_size = layer.q_heads * dim
        k_size = (qkv.shape[-1] - q_size) // 2
        q, k, v = qkv.split([q_size, k_size, k_size], dim=-1)
        (q_w, q_eps), (k_w, k_eps) = layer.qk_norm
        q = self.add_norm(q.reshape(-1, dim), None, q_w, q_eps, self.use_triton)[0]
        k = self.add_norm(k.reshape(-1, dim), None, k_w, k_eps, self.use_triton)[0]
        return torch.cat([q.view(*qkv.shape[:-1], q_size), k.view(*qkv.shape[:-1], k_size), v], dim=-1)
