"""``DecoderModel``: the Llama / Qwen2 / Mistral causal LM over a paged KV cache.

Module tree and parameter names match HF ``*ForCausalLM`` so that an HF ``state_dict``
loads key for key::

    model.embed_tokens                         nn.Embedding(vocab_size, hidden_size)
    model.layers.N.input_layernorm             RMSNorm
    model.layers.N.self_attn.{q,k,v,o}_proj    nn.Linear (q/k/v bias for Qwen2)
    model.layers.N.post_attention_layernorm    RMSNorm
    model.layers.N.mlp.{gate,up,down}_proj     SwiGLU
    model.norm                                 RMSNorm
    lm_head                                    nn.Linear(hidden_size, vocab_size), tied or not

The attention layer of block N is named ``model.layers.N.self_attn.attn``; that name
keys the per-layer KV caches, metadata and specs.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from attnplug.cache_groups.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from attnplug.core.contracts import AttentionBackend, AttentionLayerConfig, AttentionType
from attnplug.core.devices import resolve_device
from attnplug.runner.models import cpu_ops
from attnplug.runner.models.config import DecoderModelConfig
from attnplug.runner.models.cpu_linear import Linear
from attnplug.runner.models.layers import (Attention, RMSNorm, RotaryEmbedding, SwiGLUMLP, lookup_layer,
                                            lookup_metadata, merge_embeds)
from attnplug.runner.models.weights import load_hf_state_dict

BackendForLayer = Callable[[str, AttentionLayerConfig], type[AttentionBackend]]
"""``backend_for_layer(layer_name, layer_cfg) -> backend class``."""


def attention_layer_name(index: int) -> str:
    """The attention layer name of decoder block ``index``."""
    return f"model.layers.{index}.self_attn.attn"


def layer_configs(cfg: DecoderModelConfig, dtype: torch.dtype, device: torch.device | str,
                  block_size: int) -> dict[str, AttentionLayerConfig]:
    """``{layer_name: AttentionLayerConfig}`` in model order.

    Args:
        cfg: the model config.
        dtype: activation and KV-cache dtype.
        device: the model's device (only its type is recorded).
        block_size: tokens per KV-cache block.

    No layer of this family uses a logits soft-cap; ``sliding_window`` follows the config.
    """
    return {
        attention_layer_name(i): AttentionLayerConfig(
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
            head_size=cfg.head_size, dtype=dtype, kv_cache_dtype=None, block_size=block_size,
            sliding_window=cfg.sliding_windows[i], logits_soft_cap=None,
            attn_type=AttentionType.DECODER, device=torch.device(device).type)
        for i in range(cfg.num_hidden_layers)
    }


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, cfg: DecoderModelConfig, index: int, rope: RotaryEmbedding,
                 backend: type[AttentionBackend], dtype: torch.dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(
            attention_layer_name(index), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_size, rope, backend, cfg.qkv_bias, cfg.o_proj_bias, cfg.sliding_windows[index],
            dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device)

    def forward(self, hidden, positions, kv_cache, attn_metadata):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, kv_cache, attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderBody(nn.Module):
    """HF's ``*Model``: embeddings, blocks, final norm (the ``model.`` prefix). A family that
    changes only the blocks subclasses it with another ``layer_cls`` (``qwen3.py``)."""

    layer_cls: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: DecoderModelConfig, backends: list[type[AttentionBackend]],
                 dtype: torch.dtype, device):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        rope = RotaryEmbedding(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, device)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i, rope, backends[i], dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class DecoderModel(nn.Module):
    """A Llama-family causal LM whose attention runs through pluggable backends.

    Build it with :func:`attnplug.runner.models.build_model`; load HF weights with
    :meth:`load_hf_state_dict`.

    Attributes:
        config: the normalized :class:`DecoderModelConfig`.
        layer_names: attention layer names in model order.
        dtype, device: of parameters, activations and (by default) KV caches.
    """

    body_cls: type[DecoderBody] = DecoderBody

    def __init__(self, cfg: DecoderModelConfig, backends: list[type[AttentionBackend]],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.device = resolve_device(device)
        self.model = self.body_cls(cfg, backends, dtype, device)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.layer_names: list[str] = [attention_layer_name(i) for i in range(cfg.num_hidden_layers)]

    @property
    def attention_layers(self) -> dict[str, Attention]:
        """``{layer_name: Attention}`` in model order."""
        return {layer.self_attn.layer_name: layer.self_attn for layer in self.model.layers}

    def layer_configs(self, block_size: int) -> dict[str, AttentionLayerConfig]:
        """What each attention layer needs of a backend, for a KV block size.

        See :func:`layer_configs`.
        """
        return layer_configs(self.config, self.dtype, self.device, block_size)

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """``{layer_name: FullAttentionSpec | SlidingWindowSpec}`` in model order.

        A layer gets a :class:`SlidingWindowSpec` exactly when the config gives it a
        window (Mistral ``sliding_window`` may be null: then every layer is full).
        """
        cfg = self.config
        specs: dict[str, KVCacheSpec] = {}
        for i, window in enumerate(cfg.sliding_windows):
            common = dict(block_size=block_size, num_kv_heads=cfg.num_key_value_heads,
                          head_size=cfg.head_size, dtype=self.dtype)
            specs[attention_layer_name(i)] = (FullAttentionSpec(**common) if window is None
                                              else SlidingWindowSpec(**common, sliding_window=window))
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Mapping[str, object], kv_caches: Mapping[str, torch.Tensor], *,
                inputs_embeds: torch.Tensor | None = None, is_embed: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step over a flat token stream.

        Args:
            input_ids: ``[num_tokens]``, ``torch.int64``, model device.
            positions: ``[num_tokens]``, ``torch.int64``, model device; each token's position
                in its request (RoPE).
            attn_metadata: ``{layer_name: backend metadata}`` for every attention layer
                (layers of one cache group share one object).
            kv_caches: ``{layer_name: kv_cache}`` in each layer backend's layout; written
                in place at the metadata's slot mapping.
            inputs_embeds: ``None``, or ``[num_tokens, hidden_size]`` model dtype: prompt
                embeddings (``StepInputs.inputs_embeds``), used where ``is_embed``.
            is_embed: ``[num_tokens]`` ``bool``, with ``inputs_embeds``: which tokens take
                their row instead of ``embed_tokens(input_ids)``.

        Returns:
            ``[num_tokens, hidden_size]`` final hidden states (after the last norm), model dtype.

        Raises:
            MetadataError: a layer missing from ``attn_metadata`` or ``kv_caches``, or
                metadata the backend rejects.
        """
        hidden = merge_embeds(self.model.embed_tokens(input_ids), inputs_embeds, is_embed)
        if cpu_ops.enabled() and cpu_ops.takes(hidden) and self.fused_norms_apply():
            return self.forward_fused_norms(hidden, positions, attn_metadata, kv_caches)
        for layer in self.model.layers:
            name = layer.self_attn.layer_name
            hidden = layer(hidden, positions, lookup_layer(kv_caches, name, "kv_caches"),
                           lookup_metadata(attn_metadata, name))
        return self.model.norm(hidden)

    def fused_norms_apply(self) -> bool:
        """Every block is the plain pre-norm :class:`DecoderLayer` block (its ``forward``, not
        an override) with :class:`RMSNorm` norms, and so is the final norm: then
        :meth:`forward_fused_norms` computes the same thing (decided once per model)."""
        ok = self.__dict__.get("_fused_norms_apply")
        if ok is None:
            norms = [self.model.norm] + [n for layer in self.model.layers
                                         for n in (layer.input_layernorm, layer.post_attention_layernorm)]
            ok = (all(type(layer).forward is DecoderLayer.forward for layer in self.model.layers)
                  and all(type(n) is RMSNorm for n in norms))
            self.__dict__["_fused_norms_apply"] = ok
        return ok

    def forward_fused_norms(self, hidden: torch.Tensor, positions: torch.Tensor,
                            attn_metadata: Mapping[str, object], kv_caches: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """:meth:`forward`'s blocks with each residual add and the norm after it as one
        ``cpu_ops.fused_add_rms_norm`` (float32 on the CPU; vLLM's residual-stream form):
        ``x = norm_0(h)``; per block ``a = attn(x)``, ``h += a``, ``x = post_norm(h)``,
        ``m = mlp(x)``, ``h += m``, ``x = next_norm(h)`` (the next block's input norm, or the
        final norm after the last block). ``hidden`` ``[num_tokens, hidden_size]`` is the
        embedding output (this call's own tensor: it becomes the residual stream)."""
        layers = self.model.layers
        residual = hidden if hidden.is_contiguous() else hidden.contiguous()
        first = layers[0].input_layernorm if len(layers) else self.model.norm
        x = cpu_ops.rms_norm(residual, first.weight, first.eps)
        for i, layer in enumerate(layers):
            name = layer.self_attn.layer_name
            x = layer.self_attn(x, positions, lookup_layer(kv_caches, name, "kv_caches"),
                                lookup_metadata(attn_metadata, name))
            norm = layer.post_attention_layernorm
            cpu_ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
            x = layer.mlp(x)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            cpu_ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits (LM head)."""
        return self.lm_head(hidden_states).float()

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy an HF ``*ForCausalLM`` state dict into this model (strict).

        See :func:`attnplug.runner.models.weights.load_hf_state_dict`.
        """
        load_hf_state_dict(self, state_dict)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float | None = None) -> None:
        """HF-style random init: linear/embedding weights ``N(0, std)``, biases 0, norms 1.

        Args:
            seed: seeds a private CPU generator (reproducible on any device); ``None`` uses
                the global RNG.
            std: standard deviation (default: the config's ``initializer_range``).
        """
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range if std is None else std
        for name, p in self.named_parameters():  # shared (tied) weights appear once
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))
