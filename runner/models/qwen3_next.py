"""``Qwen3NextModel``: HF ``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM`` (text)
over pluggable backends.

Module tree and parameter names match HF so that its ``state_dict`` loads key for key::

    model.embed_tokens                           nn.Embedding(vocab_size, hidden_size)
    model.layers.N.input_layernorm               RMSNorm, (1 + weight)
    model.layers.N.linear_attn.*                 GatedDeltaNet ("linear_attention" layers; gdn.py)
    model.layers.N.self_attn.{q,k,v,o}_proj      gated attention ("full_attention" layers);
    model.layers.N.self_attn.{q,k}_norm          q_proj: a query and a gate per head
    model.layers.N.post_attention_layernorm      RMSNorm, (1 + weight)
    model.layers.N.mlp.*                         SwiGLU, or (Qwen3-Next sparse layers) the
                                                 MoE: mlp.gate, mlp.experts.*, mlp.shared_expert.*,
                                                 mlp.shared_expert_gate
    model.norm                                   RMSNorm, (1 + weight)
    lm_head                                      nn.Linear(hidden_size, vocab_size)

Layer names: ``model.layers.N.self_attn.attn`` (a :class:`FullAttentionSpec` group) and
``model.layers.N.linear_attn`` (a GDN :class:`StateSpec` group: one state slot per request,
conv state in the model dtype, recurrent state in float32).

Numerics are transformers 5.x's ``modeling_qwen3_next`` / ``modeling_qwen3_5`` (facts, not
code): every RMSNorm but the GDN's gated one is ``x * rsqrt(mean(x^2) + eps) * (1 + w)``
in float32; text positions make Qwen3.5's multimodal RoPE the plain partial RoPE.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from attnplug.cache_groups.specs import StateSpec, StateTensorSpec
from attnplug.core.contracts import AttentionBackend, AttentionLayerConfig
from attnplug.core.gdn import GDN_STATE_DTYPE, GDNLayerConfig
from attnplug.runner.models.attention_op import attend
from attnplug.runner.models.gdn import GatedDeltaNet
from attnplug.runner.models.gemma3 import GemmaRMSNorm as OffsetRMSNorm
from attnplug.runner.models.hybrid_lm import HybridCausalLM, HybridDecoderLayer, hybrid_layer_configs
from attnplug.runner.models.layers import Attention, SwiGLUMLP
from attnplug.runner.models.llama import attention_layer_name
from attnplug.runner.models.moe import Experts, Router
from attnplug.runner.models.qwen3_next_config import Qwen3NextModelConfig
from attnplug.runner.models.rope import RotaryEmbedding
from attnplug.runner.models.weights import init_hf_style

GDN_CHUNK_SIZE = 64
"""Chunk length of the GDN prefill scan (transformers' and flash-linear-attention's default)."""


def gdn_layer_name(index: int) -> str:
    """The GDN layer name of decoder block ``index``."""
    return f"model.layers.{index}.linear_attn"


def _gdn_layer_config(cfg: Qwen3NextModelConfig, dtype: torch.dtype, device: str, block_size: int) -> GDNLayerConfig:
    return GDNLayerConfig(
        num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
        head_k_dim=cfg.linear_key_head_dim, head_v_dim=cfg.linear_value_head_dim,
        conv_kernel_size=cfg.linear_conv_kernel_dim, chunk_size=GDN_CHUNK_SIZE, dtype=dtype,
        block_size=block_size, activation=cfg.hidden_act, device=device)


def qwen3_next_layer_configs(cfg: Qwen3NextModelConfig, dtype: torch.dtype, device: torch.device | str,
                             block_size: int) -> dict[str, AttentionLayerConfig | GDNLayerConfig]:
    """``{layer_name: AttentionLayerConfig | GDNLayerConfig}`` in model order."""
    return hybrid_layer_configs(cfg, dtype, device, block_size, gdn_layer_name, _gdn_layer_config)


def gdn_state_spec(layer_cfg: GDNLayerConfig, block_size: int) -> StateSpec:
    """The GDN layer's declared state: ``conv_state`` ``[conv_dim, conv_kernel_size - 1]`` in
    the layer dtype, ``recurrent_state`` ``[num_v_heads, head_k_dim, head_v_dim]`` in float32."""
    return StateSpec(block_size=block_size, state_kind="gdn", chunk_size=layer_cfg.chunk_size, tensors=(
        StateTensorSpec("conv_state", layer_cfg.conv_state_shape, layer_cfg.dtype),
        StateTensorSpec("recurrent_state", layer_cfg.recurrent_state_shape, layer_cfg.state_dtype)))


class GatedAttention(Attention):
    """Attention with an output gate: ``o_proj(attn(q, k, v) * sigmoid(gate))``, per-head
    ``(1 + w)`` RMSNorm on q and k, partial RoPE (HF ``Qwen3NextAttention``).

    ``q_proj`` is ``[2 * num_heads * head_size, hidden]``: per head, the query's rows then the
    gate's; it runs with ``k_proj`` and ``v_proj`` as one matmul (``fused.py``).
    """

    def __init__(self, cfg: Qwen3NextModelConfig, index: int, rope: RotaryEmbedding,
                 backend: type[AttentionBackend], dtype: torch.dtype, device):
        super().__init__(attention_layer_name(index), cfg.hidden_size, cfg.num_attention_heads,
                         cfg.num_key_value_heads, cfg.head_size, rope, backend, cfg.attention_bias,
                         cfg.attention_bias, None, dtype, device)
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * cfg.num_attention_heads * cfg.head_size,
                                bias=cfg.attention_bias, dtype=dtype, device=device)
        self.q_norm = OffsetRMSNorm(cfg.head_size, cfg.rms_norm_eps, dtype, device)
        self.k_norm = OffsetRMSNorm(cfg.head_size, cfg.rms_norm_eps, dtype, device)
        self.fuse_projections()  # again: q_proj was replaced

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        n, H, d = hidden.shape[0], self.num_heads, self.head_size
        q_gate, k, v = self.project("qkv", hidden)
        q, gate = q_gate.view(n, H, 2 * d).split([d, d], dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(n, self.num_kv_heads, d))
        v = v.view(n, self.num_kv_heads, d)
        cos, sin = self.rope.cos_sin(positions, hidden.dtype)
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        out = torch.zeros_like(q)  # padded rows stay zero
        attend(self, q.contiguous(), k, v, kv_cache, attn_metadata, out)
        return self.o_proj((out * torch.sigmoid(gate)).reshape(n, H * d))


class SharedExpertMoE(nn.Module):
    """Qwen3-Next's sparse MLP: routed experts (``moe.Router``, ``moe.Experts``) plus one
    shared SwiGLU expert scaled by ``sigmoid(shared_expert_gate(x))`` (HF
    ``Qwen3NextSparseMoeBlock``).

    ``reduce``: ``None``, or (tensor parallel) the all-reduce applied once to the block's
    partial sum (routed experts plus the gated shared expert, each on the rank's slice of
    its intermediate dimension; ``runner/parallel/gdn_sharding.py``).
    """

    def __init__(self, cfg: Qwen3NextModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.gate = Router(cfg.moe, dtype, device)
        self.experts = Experts(cfg.moe, dtype, device)
        self.shared_expert = SwiGLUMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, False, dtype, device)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=dtype, device=device)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden_size]`` -> same shape and dtype."""
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.reduce is None else self.reduce(out)


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    """``h += mixer(norm(h)); h += mlp(norm(h))``, the mixer a GDN layer or gated attention."""

    state_attr, mlp_norm_attr, mlp_attr = "linear_attn", "post_attention_layernorm", "mlp"

    def __init__(self, cfg: Qwen3NextModelConfig, index: int, layer_cfg, rope: RotaryEmbedding,
                 backend: type[AttentionBackend], dtype: torch.dtype, device):
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if isinstance(layer_cfg, GDNLayerConfig):
            self.layer_name = gdn_layer_name(index)
            self.linear_attn = GatedDeltaNet(self.layer_name, layer_cfg, cfg.hidden_size, cfg.rms_norm_eps,
                                             cfg.gdn_layout, backend, dtype, device)
        else:
            self.layer_name = attention_layer_name(index)
            self.self_attn = GatedAttention(cfg, index, rope, backend, dtype, device)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = (SharedExpertMoE(cfg, dtype, device) if cfg.sparse_layers[index]
                    else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, False, dtype, device))


class Qwen3NextBody(nn.Module):
    """HF's ``Qwen3NextModel`` / ``Qwen3_5TextModel``: embeddings, blocks, final norm."""

    def __init__(self, cfg: Qwen3NextModelConfig, layer_cfgs: list, backends: list[type[AttentionBackend]],
                 dtype: torch.dtype, device):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        rope = RotaryEmbedding(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, device)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(cfg, i, layer_cfgs[i], rope, backends[i], dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class Qwen3NextModel(HybridCausalLM):
    """A Qwen3-Next or Qwen3.5 (text) causal LM whose attention and GDN layers run through
    pluggable backends. Same step interface as
    :class:`~attnplug.runner.models.bamba.BambaModel`; the wrapper (constructor,
    ``attention_layers``, ``mamba_layers`` (the GDN layers), ``layer_configs``,
    ``kv_cache_specs``, ``forward``, ``compute_logits``, ``load_hf_state_dict`` of an HF
    ``Qwen3NextForCausalLM`` / ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` state dict)
    is :class:`~attnplug.runner.models.hybrid_lm.HybridCausalLM`.

    Args:
        cfg: the normalized config.
        backends: per decoder block, the backend of its mixer (an attention backend, or a
            :class:`~attnplug.core.gdn.GDNBackend` for GDN layers).
        dtype, device: of parameters and activations.
        block_size: recorded in the layer configs.
    """

    body_class = Qwen3NextBody
    build_layer_configs = staticmethod(qwen3_next_layer_configs)
    state_attr = "linear_attn"
    final_norm_attr = "norm"

    def state_spec(self, layer_cfg: GDNLayerConfig, block_size: int) -> StateSpec:
        """A GDN layer's :class:`StateSpec` (:func:`gdn_state_spec`)."""
        return gdn_state_spec(layer_cfg, block_size)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float | None = None) -> None:
        """HF-style random init (``weights.init_hf_style``), then the GDN and norm defaults:
        ``(1 + w)`` norms 0, ``dt_bias = 1``, ``A_log = log(1 .. num_v_heads)``."""
        init_hf_style(self, seed, self.config.initializer_range if std is None else std)
        for module in self.modules():
            if isinstance(module, OffsetRMSNorm):
                module.weight.zero_()
            elif isinstance(module, GatedDeltaNet):
                module.dt_bias.fill_(1.0)
                heads = module.A_log.shape[0]
                module.A_log.copy_(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)).to(module.A_log.dtype))


__all__ = ["GDN_CHUNK_SIZE", "GatedAttention", "Qwen3NextModel", "SharedExpertMoE", "gdn_layer_name",
           "gdn_state_spec", "qwen3_next_layer_configs"]
