"""``DeepseekV32Model``: HF ``DeepseekV32ForCausalLM`` (DeepSeek sparse attention) over a
selector backend and a sparse MLA backend.

Everything but the indexer is DeepSeek-V3's (``deepseek.py``). Each layer adds, under HF's
names (transformers 5.x ``DeepseekV32Indexer``; facts, not code)::

    model.layers.N.self_attn.indexer.wq_b            [index_n_heads * index_head_dim, q_lora_rank]
    model.layers.N.self_attn.indexer.wk              [index_head_dim, H]
    model.layers.N.self_attn.indexer.k_norm          LayerNorm(index_head_dim), eps 1e-6
    model.layers.N.self_attn.indexer.weights_proj    [index_n_heads, H]

Per step the indexer turns ``q_resid = q_a_layernorm(q_a_proj(x))`` into its queries and
``x`` into one key row per token, rotates the first ``qk_rope_head_dim`` dimensions of both
with half-split RoPE (the MLA part uses the interleaved pairing), and hands them to its
selector impl, which caches the key row in the ``indexer`` group (cache name
``model.layers.N.self_attn.indexer``) and returns ``topk_indices``; the MLA impl (a sparse
consumer) caches the latent row and attends only there (docs/mla.md, "The sparse path").
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from attnplug.cache_groups.indexer_spec import IndexerSpec
from attnplug.cache_groups.specs import KVCacheSpec
from attnplug.core.contracts import AttentionBackend
from attnplug.core.sparse import IndexerLayerConfig, SparseMLALayerConfig
from attnplug.runner.models.deepseek import DeepseekBody, DeepseekDecoderLayer, DeepseekModel, MLAAttention
from attnplug.runner.models.deepseek_v32_config import DeepseekV32ModelConfig
from attnplug.runner.models.impls import make_impl
from attnplug.runner.models.layers import RMSNorm, SwiGLUMLP, lookup_layer, lookup_metadata
from attnplug.runner.models.llama import attention_layer_name
from attnplug.runner.models.moe import MoEBlock
from attnplug.runner.models.rope import RotaryEmbedding, rotate

def indexer_layer_name(index: int) -> str:
    """The cache / metadata name of layer ``index``'s indexer (its HF module path)."""
    return f"model.layers.{index}.self_attn.indexer"


def indexer_layer_config(cfg: DeepseekV32ModelConfig, dtype: torch.dtype, device, block_size: int) -> IndexerLayerConfig:
    return IndexerLayerConfig(index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
                              index_topk=cfg.index_topk, dtype=dtype, block_size=block_size,
                              device=torch.device(device).type)


def sparse_mla_layer_config(cfg: DeepseekV32ModelConfig, dtype: torch.dtype, device, block_size: int):
    return SparseMLALayerConfig(num_heads=cfg.num_attention_heads, kv_lora_rank=cfg.kv_lora_rank,
                                qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                                v_head_dim=cfg.v_head_dim, dtype=dtype, block_size=block_size,
                                device=torch.device(device).type, index_topk=cfg.index_topk)


def deepseek_v32_layer_configs(cfg: DeepseekV32ModelConfig, dtype: torch.dtype, device,
                               block_size: int) -> dict[str, Any]:
    """``{name: layer config}``: per layer its sparse MLA, then its indexer (model order)."""
    mla = sparse_mla_layer_config(cfg, dtype, device, block_size)
    idx = indexer_layer_config(cfg, dtype, device, block_size)
    out: dict[str, Any] = {}
    for i in range(cfg.num_hidden_layers):
        out[attention_layer_name(i)] = mla
        out[indexer_layer_name(i)] = idx
    return out


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: projections, half-split RoPE, the selector impl."""

    def __init__(self, cfg: DeepseekV32ModelConfig, index: int, backend: type[AttentionBackend],
                 dtype: torch.dtype, device):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        h, d = cfg.index_n_heads, cfg.index_head_dim
        self.layer_name = indexer_layer_name(index)
        self.index_n_heads, self.index_head_dim, self.index_topk = h, d, cfg.index_topk
        self.rope_dim = cfg.qk_rope_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * d, bias=False, **kw)
        self.wk = nn.Linear(cfg.hidden_size, d, bias=False, **kw)
        self.k_norm = nn.LayerNorm(d, eps=1e-6, **kw)
        self.weights_proj = nn.Linear(cfg.hidden_size, h, bias=False, **kw)
        self.backend = backend
        self.impl = make_impl(backend, self.layer_name, indexer_layer_config(cfg, dtype, device, 16), d ** -0.5)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rope_dim
        return torch.cat([rotate(x[..., :r], cos, sin, interleaved=False), x[..., r:]], dim=-1)

    def forward(self, hidden: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata) -> torch.Tensor:
        """-> ``topk_indices`` ``[T, index_topk]`` ``torch.int32`` (writes the indexer cache)."""
        t = hidden.shape[0]
        q = self._rope(self.wq_b(q_resid).view(t, self.index_n_heads, self.index_head_dim), cos, sin)
        k = self._rope(self.k_norm(self.wk(hidden)).unsqueeze(1), cos, sin).squeeze(1)
        weights = self.weights_proj(hidden).float() * self.index_n_heads ** -0.5
        out = torch.full((t, self.index_topk), -1, dtype=torch.int32, device=hidden.device)
        return self.impl.forward(q, k, weights, kv_cache, attn_metadata, out)


class SparseMLAAttention(MLAAttention):
    """V3's MLA whose impl is a sparse consumer fed by the layer's :class:`Indexer`."""

    def __init__(self, cfg: DeepseekV32ModelConfig, index: int, rope: RotaryEmbedding,
                 backends: tuple[type[AttentionBackend], type[AttentionBackend]], dtype: torch.dtype, device):
        super().__init__(cfg, index, rope, backends[0], dtype, device)
        self.impl = make_impl(backends[0], self.layer_name, sparse_mla_layer_config(cfg, dtype, device, 16),
                              self.impl.scale)
        self.indexer = Indexer(cfg, index, backends[1], dtype, device)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache, attn_metadata) -> torch.Tensor:
        """``kv_cache`` / ``attn_metadata``: ``(latent, indexer)`` pairs."""
        (latent_cache, index_cache), (mla_md, index_md) = kv_cache, attn_metadata
        t, n, p = hidden.shape[0], self.num_heads, self.qk_nope_head_dim
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_resid).view(t, n, p + self.qk_rope_head_dim)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        cos, sin = self.rope.cos_sin(positions, hidden.dtype)
        q = torch.cat([q[..., :p], self.rope.apply(q[..., p:], cos, sin)], dim=-1)
        k_pe = self.rope.apply(k_pe.unsqueeze(1), cos, sin).squeeze(1)
        topk = self.indexer(hidden, q_resid, cos, sin, index_cache, index_md)
        out = torch.zeros(t, n, self.v_head_dim, dtype=hidden.dtype, device=hidden.device)
        self.impl.forward(self, q, self.kv_a_layernorm(kv_c), k_pe, latent_cache, mla_md, out, topk_indices=topk)
        return self.o_proj(out.view(t, n * self.v_head_dim))


class DeepseekV32DecoderLayer(DeepseekDecoderLayer):
    def __init__(self, cfg: DeepseekV32ModelConfig, index: int, rope: RotaryEmbedding, backends, dtype, device):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = SparseMLAAttention(cfg, index, rope, backends, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = (MoEBlock(cfg.moe, dtype, device) if cfg.sparse_layers[index]
                    else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device))


class DeepseekV32Body(DeepseekBody):
    """``backends``: per layer its consumer then its selector (the layer-config order)."""

    def __init__(self, cfg: DeepseekV32ModelConfig, backends: list[type[AttentionBackend]], dtype, device):
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        self.layers = nn.ModuleList(DeepseekV32DecoderLayer(cfg, i, rope, (backends[2 * i], backends[2 * i + 1]),
                                                            dtype, device) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class DeepseekV32Model(DeepseekModel):
    """A DeepSeek-V3.2 causal LM: two cache groups (``mla`` latent rows, ``indexer`` keys)."""

    body_cls = DeepseekV32Body

    def __init__(self, cfg: DeepseekV32ModelConfig, backends, dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__(cfg, backends, dtype=dtype, device=device)
        self.indexer_names = [indexer_layer_name(i) for i in range(cfg.num_hidden_layers)]

    def layer_configs(self, block_size: int) -> dict[str, Any]:
        return deepseek_v32_layer_configs(self.config, self.dtype, self.device, block_size)

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """Per layer: its ``MLAAttentionSpec`` then its :class:`IndexerSpec` (``index_head_dim``
        per token, the model dtype)."""
        latent = super().kv_cache_specs(block_size)
        index = IndexerSpec(block_size=block_size, index_head_dim=self.config.index_head_dim, dtype=self.dtype)
        out: dict[str, KVCacheSpec] = {}
        for name, idx_name in zip(self.layer_names, self.indexer_names):
            out[name], out[idx_name] = latent[name], index
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Mapping[str, object], kv_caches: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """As :meth:`DecoderModel.forward`; ``kv_caches`` / ``attn_metadata`` also hold every
        indexer's entry (``model.layers.N.self_attn.indexer``)."""
        hidden = self.model.embed_tokens(input_ids)
        for layer, idx_name in zip(self.model.layers, self.indexer_names):
            name = layer.self_attn.layer_name
            caches = (lookup_layer(kv_caches, name, "kv_caches"), lookup_layer(kv_caches, idx_name, "kv_caches"))
            mds = (lookup_metadata(attn_metadata, name), lookup_metadata(attn_metadata, idx_name))
            hidden = layer(hidden, positions, caches, mds)
        return self.model.norm(hidden)


__all__ = ["DeepseekV32Model", "SparseMLAAttention", "deepseek_v32_layer_configs", "indexer_layer_name"]
