"""``Gemma3Model``: HF ``Gemma3ForCausalLM`` (interleaved sliding and global attention).

Module tree and parameter names match HF so that its ``state_dict`` loads key for key::

    model.embed_tokens                               nn.Embedding, output * sqrt(hidden_size)
    model.layers.N.input_layernorm                   GemmaRMSNorm
    model.layers.N.self_attn.{q,k,v,o}_proj          nn.Linear (bias iff attention_bias)
    model.layers.N.self_attn.{q,k}_norm              GemmaRMSNorm over head_dim
    model.layers.N.post_attention_layernorm          GemmaRMSNorm (on the attention output)
    model.layers.N.pre_feedforward_layernorm         GemmaRMSNorm
    model.layers.N.mlp.{gate,up,down}_proj           gelu_tanh(gate) * up -> down
    model.layers.N.post_feedforward_layernorm        GemmaRMSNorm (on the MLP output)
    model.norm                                       GemmaRMSNorm
    lm_head                                          nn.Linear (tied to embed_tokens by default)

Numerics follow HF's eager code (facts, not code): ``GemmaRMSNorm`` computes
``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` in float32 and casts back; the embedding is
multiplied by ``sqrt(hidden_size)`` rounded to the model dtype; queries and keys are
RMS-normed per head before RoPE; the attention scale is ``query_pre_attn_scalar ** -0.5``;
sliding layers use the local RoPE base (``rope_local_base_freq``); logits get
``final_logit_softcapping`` (``cap * tanh(logits / cap)``, here in float32).

``attn_logit_softcapping`` is read but NOT applied, exactly as transformers'
``Gemma3Attention`` does (it stores the value and never passes it to the attention
function; Gemma 3 replaced Gemma 2's attention soft-cap by the q/k norms). Applying it
would break parity with the reference implementation of the architecture.

Layer names: ``model.layers.N.self_attn.attn``. Sliding layers get a
:class:`SlidingWindowSpec` (one cache group), global layers a :class:`FullAttentionSpec`.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from attnplug.cache_groups.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from attnplug.core.contracts import AttentionBackend, AttentionLayerConfig, AttentionType
from attnplug.core.devices import resolve_device
from attnplug.runner.models.attention_op import attend
from attnplug.runner.models.cpu_linear import Linear
from attnplug.runner.models.fused import FusedProjections
from attnplug.runner.models.gemma3_config import Gemma3ModelConfig
from attnplug.runner.models.layers import lookup_layer, lookup_metadata
from attnplug.runner.models.rope import RotaryEmbedding
from attnplug.runner.models.llama import attention_layer_name
from attnplug.runner.models.config import RopeScaling
from attnplug.runner.models.weights import load_hf_state_dict
from attnplug.runner.models.impls import make_impl


def gemma3_layer_configs(cfg: Gemma3ModelConfig, dtype: torch.dtype, device: torch.device | str,
                         block_size: int) -> dict[str, AttentionLayerConfig]:
    """``{layer_name: AttentionLayerConfig}`` in model order (window per layer; no attention
    soft-cap, see the module docstring)."""
    return {
        attention_layer_name(i): AttentionLayerConfig(
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_size=cfg.head_size,
            dtype=dtype, block_size=block_size, sliding_window=window,
            logits_soft_cap=None, attn_type=AttentionType.DECODER,
            device=torch.device(device).type)
        for i, window in enumerate(cfg.sliding_windows)
    }


class GemmaRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * (1 + weight)``, all in float32, cast back to ``x``'s
    dtype. ``weight`` starts at 0 (identity)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., dim]``; returns the same shape and dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3MLP(FusedProjections, nn.Module):
    """``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))`` (no biases); gate and up as one
    matmul (``fused.py``)."""

    fused_parts = {"gate_up": ("gate_proj", "up_proj")}

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, **kw)
        self.fuse_projections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project("gate_up", x)
        return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(FusedProjections, nn.Module):
    """Self-attention of one layer: projections (q/k/v as one matmul, ``fused.py``), per-head
    q/k RMSNorm, RoPE, backend impl."""

    fused_parts = {"qkv": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: Gemma3ModelConfig, index: int, rope: RotaryEmbedding,
                 backend: type[AttentionBackend], dtype: torch.dtype, device):
        super().__init__()
        kw = dict(bias=cfg.attention_bias, dtype=dtype, device=device)
        H, H_kv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size
        self.layer_name = attention_layer_name(index)
        self.num_heads, self.num_kv_heads, self.head_size = H, H_kv, D
        self.q_proj = nn.Linear(cfg.hidden_size, H * D, **kw)
        self.k_proj = nn.Linear(cfg.hidden_size, H_kv * D, **kw)
        self.v_proj = nn.Linear(cfg.hidden_size, H_kv * D, **kw)
        self.o_proj = Linear(H * D, cfg.hidden_size, **kw)
        self.q_norm = GemmaRMSNorm(D, cfg.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(D, cfg.rms_norm_eps, dtype, device)
        self.rope = rope
        self.sliding_window = cfg.sliding_windows[index]
        self.backend = backend
        self.impl = make_impl(
            backend, self.layer_name, H, D, cfg.attention_scale, H_kv, sliding_window=self.sliding_window,
            logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_cache_dtype=dtype)
        self.fuse_projections()

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        n = hidden.shape[0]
        q, k, v = self.project("qkv", hidden)
        q = self.q_norm(q.view(n, self.num_heads, self.head_size))
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_size))
        v = v.view(n, self.num_kv_heads, self.head_size)
        cos, sin = self.rope.cos_sin(positions, hidden.dtype)
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        out = torch.zeros_like(q)
        attend(self, q, k, v, kv_cache, attn_metadata, out)
        return self.o_proj(out.view(n, self.num_heads * self.head_size))


class Gemma3DecoderLayer(nn.Module):
    """``h += post_attn_norm(attn(in_norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h)))``."""

    def __init__(self, cfg: Gemma3ModelConfig, index: int, rope: RotaryEmbedding,
                 backend: type[AttentionBackend], dtype: torch.dtype, device):
        super().__init__()
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Gemma3Attention(cfg, index, rope, backend, dtype, device)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = Gemma3MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        self.post_feedforward_layernorm = norm()

    def forward(self, hidden, positions, kv_cache, attn_metadata):
        attn = self.self_attn(self.input_layernorm(hidden), positions, kv_cache, attn_metadata)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Body(nn.Module):
    """HF's ``Gemma3TextModel`` (the ``model.`` prefix): embeddings, blocks, final norm."""

    def __init__(self, cfg: Gemma3ModelConfig, backends: list[type[AttentionBackend]], dtype: torch.dtype, device):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        # RoPE tables are not parameters (HF keeps them as non-persistent buffers).
        global_rope = RotaryEmbedding(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, device)
        local_rope = RotaryEmbedding(cfg.head_size, cfg.rope_local_theta, RopeScaling(), device)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, local_rope if t == "sliding_attention" else global_rope, backends[i],
                               dtype, device)
            for i, t in enumerate(cfg.layer_types))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class Gemma3Model(nn.Module):
    """A Gemma3 causal LM whose attention runs through pluggable backends.

    Build it with :func:`attnplug.runner.models.build_model`; load HF weights with
    :meth:`load_hf_state_dict`. Same interface as ``llama.DecoderModel`` (``forward``,
    ``compute_logits``, ``kv_cache_specs``, ``layer_configs``, ``layer_names``).

    Attributes:
        config: the normalized :class:`Gemma3ModelConfig`.
        layer_names: attention layer names in model order.
        dtype, device: of parameters, activations and (by default) KV caches.
    """

    def __init__(self, cfg: Gemma3ModelConfig, backends: list[type[AttentionBackend]],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.device = resolve_device(device)
        self.model = Gemma3Body(cfg, backends, dtype, device)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # sqrt(hidden_size) as HF stores it: a float32 scalar rounded to the model dtype.
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5).to(dtype), persistent=False)
        self.layer_names: list[str] = [attention_layer_name(i) for i in range(cfg.num_hidden_layers)]

    @property
    def attention_layers(self) -> dict[str, Gemma3Attention]:
        """``{layer_name: Gemma3Attention}`` in model order."""
        return {layer.self_attn.layer_name: layer.self_attn for layer in self.model.layers}

    def layer_configs(self, block_size: int) -> dict[str, AttentionLayerConfig]:
        """What each attention layer needs of a backend (see :func:`gemma3_layer_configs`)."""
        return gemma3_layer_configs(self.config, self.dtype, self.device, block_size)

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """``{layer_name: SlidingWindowSpec | FullAttentionSpec}`` in model order."""
        cfg = self.config
        common = dict(block_size=block_size, num_kv_heads=cfg.num_key_value_heads, head_size=cfg.head_size,
                      dtype=self.dtype)
        return {attention_layer_name(i): (FullAttentionSpec(**common) if w is None
                                          else SlidingWindowSpec(**common, sliding_window=w))
                for i, w in enumerate(cfg.sliding_windows)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Mapping[str, object], kv_caches: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run one step over a flat token stream.

        Args:
            input_ids: ``[num_tokens]`` int32/int64, model device.
            positions: ``[num_tokens]`` ``torch.int64``, model device (RoPE positions).
            attn_metadata: ``{layer_name: backend metadata}`` (layers of a group share one).
            kv_caches: ``{layer_name: kv_cache}`` in each layer backend's layout.

        Returns:
            ``[num_tokens, hidden_size]`` final hidden states (after the last norm).

        Raises:
            MetadataError: a layer missing from ``attn_metadata`` or ``kv_caches``, or
                metadata the backend rejects.
        """
        hidden = self.model.embed_tokens(input_ids) * self.embed_scale
        for layer in self.model.layers:
            name = layer.self_attn.layer_name
            hidden = layer(hidden, positions, lookup_layer(kv_caches, name, "kv_caches"),
                           lookup_metadata(attn_metadata, name))
        return self.model.norm(hidden)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits, soft-capped by
        ``final_logit_softcapping`` when set."""
        logits = self.lm_head(hidden_states).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy an HF ``Gemma3ForCausalLM`` state dict into this model (strict; see
        :func:`attnplug.runner.models.weights.load_hf_state_dict`)."""
        load_hf_state_dict(self, state_dict)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float | None = None) -> None:
        """HF-style random init: linear/embedding weights ``N(0, std)``, biases 0, norm
        weights 0 (``GemmaRMSNorm`` scales by ``1 + weight``).

        Args:
            seed: seeds a private CPU generator (reproducible on any device); ``None`` uses
                the global RNG.
            std: standard deviation (default: the config's ``initializer_range``).
        """
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range if std is None else std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))
