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

import torch
from torch import nn

from attnplug.cache_groups.specs import MambaSpec
from attnplug.core.contracts import AttentionBackend, AttentionLayerConfig
from attnplug.core.mamba import MambaLayerConfig
from attnplug.runner.models.bamba_config import BambaModelConfig
from attnplug.runner.models.hybrid_lm import HybridCausalLM, HybridDecoderLayer, hybrid_layer_configs
from attnplug.runner.models.layers import Attention, RMSNorm, RotaryEmbedding, SwiGLUMLP
from attnplug.runner.models.llama import attention_layer_name
from attnplug.runner.models.mamba2 import Mamba2Mixer

SSM_STATE_DTYPE = torch.float32
"""SSM states are kept in float32 whatever the activation dtype (HF's torch path computes
the scan, and so the cached state, in float32)."""


def mamba_layer_name(index: int) -> str:
    """The Mamba2 layer name of decoder block ``index``."""
    return f"model.layers.{index}.mamba"


def _mamba_layer_config(cfg: BambaModelConfig, dtype: torch.dtype, device: str, block_size: int) -> MambaLayerConfig:
    return MambaLayerConfig(
        num_heads=cfg.mamba_n_heads, head_size=cfg.mamba_head_size, state_size=cfg.mamba_d_state,
        n_groups=cfg.mamba_n_groups, conv_kernel_size=cfg.mamba_d_conv, chunk_size=cfg.mamba_chunk_size,
        dtype=dtype, ssm_dtype=SSM_STATE_DTYPE, block_size=block_size, activation=cfg.hidden_act,
        time_step_limit=cfg.time_step_limit, device=device)


def bamba_layer_configs(cfg: BambaModelConfig, dtype: torch.dtype, device: torch.device | str,
                        block_size: int) -> dict[str, AttentionLayerConfig | MambaLayerConfig]:
    """``{layer_name: AttentionLayerConfig | MambaLayerConfig}`` in model order."""
    return hybrid_layer_configs(cfg, dtype, device, block_size, mamba_layer_name, _mamba_layer_config)


class BambaDecoderLayer(HybridDecoderLayer):
    """``h += mixer(norm(h)); h += mlp(norm(h))``, the mixer a Mamba2 layer or attention."""

    state_attr, mlp_norm_attr, mlp_attr = "mamba", "pre_ff_layernorm", "feed_forward"

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


class BambaModel(HybridCausalLM):
    """A Bamba causal LM whose attention and Mamba2 layers run through pluggable backends.

    Build it with :func:`attnplug.runner.models.build_model`; load HF weights
    (``BambaForCausalLM``) with :meth:`load_hf_state_dict`. Same step interface as
    :class:`~attnplug.runner.models.llama.DecoderModel`; the wrapper (constructor,
    ``attention_layers``, ``mamba_layers``, ``layer_configs``, ``kv_cache_specs``,
    ``forward``, ``compute_logits``) is :class:`~attnplug.runner.models.hybrid_lm.HybridCausalLM`.

    Args:
        cfg: the normalized config.
        backends: per decoder block, the backend of its mixer (an attention backend for
            attention layers, a :class:`~attnplug.core.mamba.MambaBackend` for Mamba2).
        dtype, device: of parameters and activations.
        block_size: recorded in the layer configs of the Mamba layers.

    Attributes:
        layer_names: every layer name (attention and Mamba) in model order.
    """

    body_class = BambaBody
    build_layer_configs = staticmethod(bamba_layer_configs)
    state_attr = "mamba"
    final_norm_attr = "final_layernorm"

    def state_spec(self, layer_cfg: MambaLayerConfig, block_size: int) -> MambaSpec:
        """A Mamba layer's :class:`MambaSpec`: conv state ``[conv_dim, d_conv - 1]`` in the
        model dtype, SSM state ``[mamba_n_heads, mamba_d_head, mamba_d_state]`` in float32,
        ``chunk_size = mamba_chunk_size``; ``block_size`` is only the manager's accounting
        unit (a request holds one block = one state slot)."""
        return MambaSpec(block_size=block_size, conv_state_shape=layer_cfg.conv_state_shape,
                         ssm_state_shape=layer_cfg.ssm_state_shape, dtype=self.dtype,
                         ssm_dtype=layer_cfg.ssm_dtype, chunk_size=layer_cfg.chunk_size)

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
