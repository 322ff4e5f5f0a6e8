"""The decoder stack of a Llama-family HF model (llama, mistral, qwen2, qwen3) run as ten kernels a layer.

Per layer: add + RMSNorm, one QKV GEMM, rotary + KV write, attention (two kernels), o_proj,
add + RMSNorm, one gate/up GEMM, SiLU-and-multiply, down_proj. HF's eager layer launches ~45.
Qwen3 adds an RMSNorm over each query and key head before the rotary (its q_norm / k_norm): two
more norm kernels and a concatenation a layer.
The weights are the HF model's own: Q, K and V (and gate and up) are concatenated once and the HF
parameters become views into the concatenation, so no memory is duplicated and the HF model keeps
working unchanged (reference decoding in tests, `generate`).

Other architectures run the HF modules through PoolCache (lanes/model_runner.py).
"""

import torch
import torch.nn.functional as F

from lanes.attention import PoolAttentionMeta, attend
from lanes.fused_ops import add_rms_norm, rope_store, silu_and_mul
from lanes.kv_pool import KVPool

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
QK_NORM_TYPES = ("qwen3",)  # per-head RMSNorm of queries and keys before the rotary
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # tables that depend on the position only


def supports(model: torch.nn.Module) -> bool:
    """Whether `model` is a plain pre-norm Llama-style decoder this module computes exactly."""
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
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    sliding = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
    if text.model_type not in SUPPORTED_TYPES:
        return f"model_type={text.model_type!r}"
    if text.hidden_act != "silu":
        return f"hidden_act={text.hidden_act!r}"
    if sliding:
        return f"sliding_window={sliding}"
    rope_type = rope.get("rope_type", "default")
    return f"rope_type={rope_type!r}" if rope_type not in STATIC_ROPE else None


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


class _Layer:
    def __init__(self, layer: torch.nn.Module):
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
        self.in_norm = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.post_norm = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        self.q_heads = attn.q_proj.weight.shape[0] // attn.head_dim
        self.head_dim = attn.head_dim
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qk_norm = (None if q_norm is None else
                        ((q_norm.weight, q_norm.variance_epsilon), (k_norm.weight, k_norm.variance_epsilon)))
        self.scale = attn.scaling
        self.layer_idx = attn.layer_idx


class FusedDecoder:
    def __init__(self, model: torch.nn.Module, pool: KVPool, use_triton: bool, row_linear=F.linear):
        """`row_linear`: how o_proj and down_proj are applied, F.linear itself or, over the shards of a
        tensor-parallel model, F.linear followed by the all-reduce (lanes/tensor_parallel.py)."""
        decoder = model.get_decoder()
        self.embed = decoder.embed_tokens
        self.layers = [_Layer(layer) for layer in decoder.layers]
        self.norm = (decoder.norm.weight, decoder.norm.variance_epsilon)
        self.pool = pool
        self.use_triton = use_triton
        self.row_linear = row_linear
        self.cos, self.sin = self._rope_table(decoder, pool.shape.capacity_tokens)

    @staticmethod
    def _rope_table(decoder, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's own cos/sin for every position a slot can hold: [positions, D/2] each, model dtype.
        (HF's table is two copies of the half; rotary scaling types are HF's business.)"""
        weight = decoder.embed_tokens.weight
        cos, sin = decoder.rotary_emb(weight[:1], torch.arange(positions, device=weight.device)[None])
        half = cos.shape[-1] // 2
        return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()

    def __call__(self, input_ids: torch.Tensor, meta: PoolAttentionMeta) -> torch.Tensor:
        """input_ids [B, Q] at positions meta.kv_lens[b] + i of slots meta.slot_ids -> hidden [B, Q, H]."""
        batch, q_len = input_ids.shape
        hidden = self.embed(input_ids).view(batch * q_len, -1)  # [T, H]
        residual = None
        for layer in self.layers:
            normed, residual = add_rms_norm(hidden, residual, *layer.in_norm, self.use_triton)
            attn = self._attention(layer, normed.view(batch, q_len, -1), meta)
            normed, residual = add_rms_norm(self.row_linear(attn, layer.o_w, layer.o_b), residual, *layer.post_norm,
                                            self.use_triton)
            gate_up = F.linear(normed, layer.gate_up_w, layer.gate_up_b)  # [T, 2I]
            hidden = self.row_linear(silu_and_mul(gate_up, self.use_triton), layer.down_w, layer.down_b)
        out, _ = add_rms_norm(hidden, residual, *self.norm, self.use_triton)
        return out.view(batch, q_len, -1)

    def _attention(self, layer: _Layer, normed: torch.Tensor, meta: PoolAttentionMeta) -> torch.Tensor:
        batch, q_len, _ = normed.shape
        qkv = F.linear(normed, layer.qkv_w, layer.qkv_b)  # [B, Q, (Hq + 2 Hkv) * D]
        if layer.qk_norm is not None:
            qkv = self._norm_heads(qkv, layer)
        k_pool, v_pool = self.pool.layer(layer.layer_idx)  # [blocks, Hkv, block_size, D]
        query = rope_store(qkv, self.cos, self.sin, meta.block_table, meta.slot_ids, meta.kv_lens, k_pool, v_pool,
                           layer.q_heads, self.use_triton)  # [B, Q, Hq, D]
        out = attend(query.transpose(1, 2), k_pool, v_pool, meta, layer.scale)  # [B, Q, Hq, D]
        return out.reshape(batch * q_len, -1)

    def _norm_heads(self, qkv: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """Qwen3's RMSNorm of every query and key head [D] (HF's q_norm / k_norm), values untouched."""
        dim = layer.head_dim
        q_size = layer.q_heads * dim
        k_size = (qkv.shape[-1] - q_size) // 2
        q, k, v = qkv.split([q_size, k_size, k_size], dim=-1)
        (q_w, q_eps), (k_w, k_eps) = layer.qk_norm
        q = add_rms_norm(q.reshape(-1, dim), None, q_w, q_eps, self.use_triton)[0]
        k = add_rms_norm(k.reshape(-1, dim), None, k_w, k_eps, self.use_triton)[0]
        return torch.cat([q.view(*qkv.shape[:-1], q_size), k.view(*qkv.shape[:-1], k_size), v], dim=-1)
