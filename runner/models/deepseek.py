"""``DeepseekModel``: HF ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` over MLA backends.

Module tree and parameter names match transformers 5.24's DeepSeek-V2/V3 (facts, not code)::

    model.layers.N.self_attn.q_proj                  [N * (P + R), H]   (q_lora_rank null)
    model.layers.N.self_attn.q_a_proj                [q_lora_rank, H]   (+ q_a_layernorm, q_b_proj)
    model.layers.N.self_attn.kv_a_proj_with_mqa      [L + R, H]
    model.layers.N.self_attn.kv_a_layernorm          RMSNorm(L)
    model.layers.N.self_attn.kv_b_proj               [N * (P + V), L]
    model.layers.N.self_attn.o_proj                  [H, N * V]
    model.layers.N.mlp                               SwiGLU (layers < first_k_dense_replace)
                                                     or moe.MoEBlock (routed + shared experts)

``L = kv_lora_rank``, ``R = qk_rope_head_dim``, ``P = qk_nope_head_dim``, ``V = v_head_dim``.
Each attention layer hands its MLA impl ``q`` ``[T, N, P + R]`` (``q_pe`` rotated),
``kv_c_normed`` ``[T, L]`` and the rotated ``k_pe`` ``[T, R]``; the impl caches the latent
row and attends (docs/mla.md). Softmax scale: ``(P + R) ** -0.5`` times YaRN's
``mscale(factor, mscale_all_dim) ** 2`` (``rope.yarn_softmax_scale``).
"""

from __future__ import annotations

import torch
from torch import nn

from attnplug.cache_groups.specs import KVCacheSpec, MLAAttentionSpec
from attnplug.core.contracts import AttentionBackend
from attnplug.core.mla import MLALayerConfig
from attnplug.runner.models.deepseek_config import DeepseekModelConfig
from attnplug.runner.models.impls import make_impl
from attnplug.runner.models.layers import RMSNorm, SwiGLUMLP
from attnplug.runner.models.llama import DecoderBody, DecoderLayer, DecoderModel, attention_layer_name
from attnplug.runner.models.moe import MoEBlock
from attnplug.runner.models.rope import RotaryEmbedding, yarn_softmax_scale
from attnplug.runner.models.weights import init_hf_style


def mla_layer_config(cfg: DeepseekModelConfig, dtype: torch.dtype, device, block_size: int) -> MLALayerConfig:
    return MLALayerConfig(num_heads=cfg.num_attention_heads, kv_lora_rank=cfg.kv_lora_rank,
                          qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                          v_head_dim=cfg.v_head_dim, dtype=dtype, block_size=block_size,
                          device=torch.device(device).type)


def deepseek_layer_configs(cfg: DeepseekModelConfig, dtype: torch.dtype, device,
                           block_size: int) -> dict[str, MLALayerConfig]:
    """``{layer_name: MLALayerConfig}`` in model order (every layer is MLA)."""
    layer = mla_layer_config(cfg, dtype, device, block_size)
    return {attention_layer_name(i): layer for i in range(cfg.num_hidden_layers)}


class MLAAttention(nn.Module):
    """DeepSeek's multi-head latent attention: projections, RoPE on the rope parts, MLA impl."""

    def __init__(self, cfg: DeepseekModelConfig, index: int, rope: RotaryEmbedding,
                 backend: type[AttentionBackend], dtype: torch.dtype, device):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        n, p, r, v, lr = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                          cfg.kv_lora_rank)
        self.layer_name = attention_layer_name(index)
        self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = n, p, r, v
        self.kv_lora_rank = lr
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, n * (p + r), bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype, device)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, n * (p + r), bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, lr + r, bias=cfg.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(lr, cfg.rms_norm_eps, dtype, device)
        self.kv_b_proj = nn.Linear(lr, n * (p + v), bias=False, **kw)
        self.o_proj = nn.Linear(n * v, cfg.hidden_size, bias=cfg.attention_bias, **kw)
        self.rope = rope
        self.backend = backend
        scale = (p + r) ** -0.5 * yarn_softmax_scale(cfg.rope_scaling)
        self.impl = make_impl(backend, self.layer_name, mla_layer_config(cfg, dtype, device, 16), scale)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` -> ``[T, hidden_size]``; writes the latent cache."""
        t, n, p = hidden.shape[0], self.num_heads, self.qk_nope_head_dim
        q = self.q_proj(hidden) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(t, n, p + self.qk_rope_head_dim)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        cos, sin = self.rope.cos_sin(positions, hidden.dtype)
        q = torch.cat([q[..., :p], self.rope.apply(q[..., p:], cos, sin)], dim=-1)
        k_pe = self.rope.apply(k_pe.unsqueeze(1), cos, sin).squeeze(1)
        out = torch.zeros(t, n, self.v_head_dim, dtype=hidden.dtype, device=hidden.device)  # padded rows stay zero
        self.impl.forward(self, q, self.kv_a_layernorm(kv_c), k_pe, kv_cache, attn_metadata, out)
        return self.o_proj(out.view(t, n * self.v_head_dim))


class DeepseekDecoderLayer(DecoderLayer):
    """Pre-norm block with MLA, and the MoE block on sparse layers."""

    def __init__(self, cfg: DeepseekModelConfig, index: int, rope: RotaryEmbedding,
                 backend: type[AttentionBackend], dtype: torch.dtype, device):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = MLAAttention(cfg, index, rope, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = (MoEBlock(cfg.moe, dtype, device) if cfg.sparse_layers[index]
                    else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device))


class DeepseekBody(DecoderBody):
    """HF's ``DeepseekV2Model`` / ``DeepseekV3Model``: RoPE over ``qk_rope_head_dim``."""

    def __init__(self, cfg: DeepseekModelConfig, backends: list[type[AttentionBackend]], dtype: torch.dtype, device):
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, rope, backends[i], dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class DeepseekModel(DecoderModel):
    """A DeepSeek-V2/V3 causal LM whose MLA layers run through pluggable MLA backends
    (the :class:`~attnplug.runner.models.llama.DecoderModel` interface)."""

    body_cls = DeepseekBody

    def layer_configs(self, block_size: int) -> dict[str, MLALayerConfig]:
        return deepseek_layer_configs(self.config, self.dtype, self.device, block_size)

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """``{layer_name: MLAAttentionSpec}``: one latent row of ``kv_lora_rank +
        qk_rope_head_dim`` per token and layer."""
        cfg = self.config
        spec = MLAAttentionSpec(block_size=block_size, kv_lora_rank=cfg.kv_lora_rank,
                                qk_rope_head_dim=cfg.qk_rope_head_dim, dtype=self.dtype)
        return {name: spec for name in self.layer_names}

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float | None = None) -> None:
        """HF-style random init: weights ``N(0, std)``, biases (the routers' correction biases
        too) 0, every norm 1."""
        init_hf_style(self, seed, self.config.initializer_range if std is None else std)


__all__ = ["DeepseekModel", "MLAAttention", "deepseek_layer_configs"]
