"""``BambaModel``: HF ``BambaForCausalLM`` (Mamba2 + attention hybrid) over pluggable backends.

Module tree and parameter names match HF so that its ``state_dict`` loads key for key::

    model.embed_tokens                           nn.Embedding(vocab_size, hidden_size)
    model.layers.N.input_layernorm               RMSNorm
    model.layers.N.mamba.*                       Mamba2Mixer (layers not in attn_layer_indices)
    model.layers.N.self_attn.{q,k,v,o}_proj      attention (layers in attn_layer_indices)
    model.layers.N.pre_ff_layernorm              RMSNorm
    model.layers.N.feed_forward.{gate,up,down}_proj   SwiGLU
    model.final_layernorm                        RMSNorm
    lm_head                                      nn.Linear(hidden_size, vocab_size)

Layer names (keys of caches, metadata and specs): ``model.layers.N.self_attn.attn`` for
attention (a :class:`FullAttentionSpec` group), ``model.layers.N.mamba`` for Mamba2 (a
:class:`MambaSpec` group: one state slot per request).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from attnplug.cache_groups.specs import FullAttentionSpec, KVCacheSpec, MambaSpec
from attnplug.core.contracts import AttentionBackend, AttentionLayerConfig, AttentionType
from attnplug.core.devices import resolve_device
from attnplug.core.mamba import MambaLayerConfig
from attnplug.runner.models.bamba_config import BambaModelConfig
from attnplug.runner.models.layers import (Attention, RMSNorm, RotaryEmbedding, SwiGLUMLP, lookup_layer,
                                            lookup_metadata)
from attnplug.runner.models.llama import attention_layer_name
from attnplug.runner.models.mamba2 import Mamba2Mixer
from attnplug.runner.models.weights import load_hf_state_dict

SSM_STATE_DTYPE = torch.float32
"""SSM states are kept in float32 whatever the activation dtype (HF's torch path computes
the scan, and so the cached state, in float32)."""


def mamba_layer_name(index: int) -> str:
    """The Mamba2 layer name of decoder block ``index``."""
    return f"model.layers.{index}.mamba"


def bamba_layer_configs(cfg: BambaModelConfig, dtype: torch.dtype, device: torch.device | str,
                        block_size: int) -> dict[str, AttentionLayerConfig | MambaLayerConfig]:
    """``{layer_name: AttentionLayerConfig | MambaLayerConfig}`` in model order."""
    dev = torch.device(device).type
    out: dict[str, AttentionLayerConfig | MambaLayerConfig] = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            out[attention_layer_name(i)] = AttentionLayerConfig(
                num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_size=cfg.head_size,
                dtype=dtype, block_size=block_size, attn_type=AttentionType.DECODER, device=dev)
        else:
            out[mamba_layer_name(i)] = MambaLayerConfig(
                num_heads=cfg.mamba_n_heads, head_size=cfg.mamba_head_size, state_size=cfg.mamba_d_state,
                n_groups=cfg.mamba_n_groups, conv_kernel_size=cfg.mamba_d_conv, chunk_size=cfg.mamba_chunk_size,
                dtype=dtype, ssm_dtype=SSM_STATE_DTYPE, block_size=block_size, activation=cfg.hidden_act,
                time_step_limit=cfg.time_step_limit, device=dev)
    return out


class BambaDecoderLayer(nn.Module):
    """``h += mixer(norm(h)); h += mlp(norm(h))``, the mixer a Mamba2 layer or attention."""

    def __init__(self, cfg: BambaModelConfig, index: int, layer_cfg, rope: RotaryEmbedding,
                 backend: type[AttentionBackend], dtype: torch.dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if isinstance(layer_cfg, MambaLayerConfig):
            self.layer_name = mamba_layer_name(index)
            self.mamba = Mamba2Mixer(self.layer_name, layer_cfg, cfg.hidden_size, cfg.mamba_conv_bias,
                                     cfg.mamba_proj_bias, cfg.rms_norm_eps, backend, dtype, device)
        else:
            self.layer_name = attention_layer_name(index)
            self.self_attn = Attention(self.layer_name, cfg.hidden_size, cfg.num_attention_heads,
                                       cfg.num_key_value_heads, cfg.head_size, rope, backend, cfg.attention_bias,
                                       cfg.attention_bias, None, dtype, device)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.feed_forward = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device)

    def forward(self, hidden, positions, cache, attn_metadata):
        h = self.input_layernorm(hidden)
        if hasattr(self, "mamba"):
            h = self.mamba(h, cache, attn_metadata)
        else:
            h = self.self_attn(h, positions, cache, attn_metadata)
        hidden = hidden + h
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class BambaBody(nn.Module):
    """HF's ``BambaModel``: embeddings, blocks, final norm (the ``model.`` prefix)."""

    def __init__(self, cfg: BambaModelConfig, layer_cfgs: list, backends: list[type[AttentionBackend]],
                 dtype: torch.dtype, device):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        rope = RotaryEmbedding(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, device, rotary_dim=cfg.rotary_dim)
        self.layers = nn.ModuleList(BambaDecoderLayer(cfg, i, layer_cfgs[i], rope, backends[i], dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class BambaModel(nn.Module):
    """A Bamba causal LM whose attention and Mamba2 layers run through pluggable backends.

    Build it with :func:`attnplug.runner.models.build_model`; load HF weights with
    :meth:`load_hf_state_dict`. Same step interface as
    :class:`~attnplug.runner.models.llama.DecoderModel`.

    Args:
        cfg: the normalized config.
        backends: per decoder block, the backend of its mixer (an attention backend for
            attention layers, a :class:`~attnplug.core.mamba.MambaBackend` for Mamba2).
        dtype, device: of parameters and activations.
        block_size: recorded in the layer configs of the Mamba layers.

    Attributes:
        layer_names: every layer name (attention and Mamba) in model order.
    """

    def __init__(self, cfg: BambaModelConfig, backends: list[type[AttentionBackend]],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", block_size: int = 16):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.device = resolve_device(device)
        layer_cfgs = list(bamba_layer_configs(cfg, dtype, device, block_size).values())
        self.model = BambaBody(cfg, layer_cfgs, backends, dtype, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.layer_names: list[str] = [layer.layer_name for layer in self.model.layers]

    @property
    def attention_layers(self) -> dict[str, Attention]:
        """``{layer_name: Attention}`` of the attention layers, in model order."""
        return {l.layer_name: l.self_attn for l in self.model.layers if hasattr(l, "self_attn")}

    @property
    def mamba_layers(self) -> dict[str, Mamba2Mixer]:
        """``{layer_name: Mamba2Mixer}`` of the Mamba2 layers, in model order."""
        return {l.layer_name: l.mamba for l in self.model.layers if hasattr(l, "mamba")}

    def layer_configs(self, block_size: int) -> dict[str, AttentionLayerConfig | MambaLayerConfig]:
        """What each layer needs of a backend (see :func:`bamba_layer_configs`)."""
        return bamba_layer_configs(self.config, self.dtype, self.device, block_size)

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """``{layer_name: FullAttentionSpec | MambaSpec}`` in model order.

        Mamba layers: conv state ``[conv_dim, d_conv - 1]`` in the model dtype, SSM state
        ``[mamba_n_heads, mamba_d_head, mamba_d_state]`` in float32, ``chunk_size =
        mamba_chunk_size``; ``block_size`` is only the manager's accounting unit (a
        request holds one block = one state slot).
        """
        cfg = self.config
        specs: dict[str, KVCacheSpec] = {}
        for name, lc in self.layer_configs(block_size).items():
            if isinstance(lc, MambaLayerConfig):
                specs[name] = MambaSpec(block_size=block_size, conv_state_shape=lc.conv_state_shape,
                                        ssm_state_shape=lc.ssm_state_shape, dtype=self.dtype,
                                        ssm_dtype=lc.ssm_dtype, chunk_size=lc.chunk_size)
            else:
                specs[name] = FullAttentionSpec(block_size=block_size, num_kv_heads=cfg.num_key_value_heads,
                                                head_size=cfg.head_size, dtype=self.dtype)
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Mapping[str, object],
                kv_caches: Mapping[str, object]) -> torch.Tensor:
        """Run one step over a flat token stream (see ``DecoderModel.forward``).

        ``kv_caches[name]`` is a paged KV tensor for attention layers and a
        :class:`~attnplug.core.mamba.MambaStateCache` for Mamba2 layers;
        ``attn_metadata[name]`` is the layer's group metadata.

        Raises:
            MetadataError: a layer missing from ``attn_metadata`` or ``kv_caches``.
        """
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            name = layer.layer_name
            hidden = layer(hidden, positions, lookup_layer(kv_caches, name, "kv_caches"),
                           lookup_metadata(attn_metadata, name))
        return self.model.final_layernorm(hidden)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits (LM head)."""
        return self.lm_head(hidden_states).float()

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy an HF ``BambaForCausalLM`` state dict into this model (strict; see
        :func:`attnplug.runner.models.weights.load_hf_state_dict`)."""
        load_hf_state_dict(self, state_dict)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float | None = None) -> None:
        """HF-style random init: linear/embedding/conv weights ``N(0, std)``, biases 0, norms 1,
        and the Mamba2 defaults ``A_log = log(1..num_heads)``, ``D = 1``, ``dt_bias = 1``.

        Args:
            seed: seeds a private CPU generator; ``None`` uses the global RNG.
            std: standard deviation (default: the config's ``initializer_range``).
        """
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range if std is None else std
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.log(torch.arange(1, p.shape[0] + 1, dtype=torch.float32)).to(p.dtype))
            elif leaf in ("D", "dt_bias") or (leaf == "weight" and "norm" in name):
                p.fill_(1.0)
            elif leaf == "bias":
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))
