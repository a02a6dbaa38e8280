"""``BambaModelConfig``: the normalized facts of an HF ``BambaForCausalLM`` config.

Field names and defaults follow transformers' ``BambaConfig`` (model_type ``"bamba"``):
layers listed in ``attn_layer_indices`` are full attention, every other layer is a
Mamba2 mixer. ``mamba_d_head = "auto"`` means ``mamba_expand * hidden_size //
mamba_n_heads``. Attention rotates only the first ``partial_rotary_factor`` of each head
(HF fixes it to 0.5 for Bamba unless ``rope_parameters`` says otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from attnplug.runner.models.config import (DecoderSizes, ModelConfigError, RopeScaling, parse_rope,
                                           positive_int_problems)


@dataclass(frozen=True)
class BambaModelConfig(DecoderSizes):
    """A Bamba hybrid decoder (Mamba2 + attention layers), normalized.

    ``head_size`` is the attention head size (``hidden_size // num_attention_heads``
    unless ``head_dim`` is given); ``rotary_dim`` of its dimensions are rotated.
    ``mamba_head_size`` is HF ``mamba_d_head``.
    """

    rotary_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    attn_layer_indices: tuple[int, ...]
    mamba_n_heads: int
    mamba_head_size: int
    mamba_n_groups: int
    mamba_d_state: int
    mamba_d_conv: int
    mamba_expand: int
    mamba_chunk_size: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    time_step_limit: tuple[float, float]
    initializer_range: float = 0.02
    hidden_act: str = "silu"

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Per layer ``"full_attention"`` or ``"mamba"``."""
        attn = set(self.attn_layer_indices)
        return tuple("full_attention" if i in attn else "mamba" for i in range(self.num_hidden_layers))

    @property
    def mamba_intermediate_size(self) -> int:
        """``mamba_expand * hidden_size`` (== ``mamba_n_heads * mamba_head_size``)."""
        return self.mamba_expand * self.hidden_size

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the conv1d: ``mamba_intermediate_size + 2 * n_groups * d_state``."""
        return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.mamba_d_state

    def __post_init__(self):
        problems = positive_int_problems(self, (
            *self.SIZE_FIELDS, "mamba_n_heads", "mamba_head_size", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
            "mamba_expand", "mamba_chunk_size"), bool_ok=True)
        if not problems:
            if self.num_attention_heads % self.num_key_value_heads:
                problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                                f"num_key_value_heads {self.num_key_value_heads}")
            if self.mamba_n_heads * self.mamba_head_size != self.mamba_intermediate_size:
                problems.append(f"mamba_n_heads * mamba_d_head = {self.mamba_n_heads * self.mamba_head_size} "
                                f"must equal mamba_expand * hidden_size = {self.mamba_intermediate_size}")
            if self.mamba_n_heads % self.mamba_n_groups:
                problems.append(f"mamba_n_heads {self.mamba_n_heads} is not a multiple of mamba_n_groups "
                                f"{self.mamba_n_groups}")
            if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_size:
                problems.append(f"rotary dims {self.rotary_dim} must be even and in (0, head_dim={self.head_size}]")
        bad = [i for i in self.attn_layer_indices if not 0 <= i < self.num_hidden_layers]
        if bad:
            problems.append(f"attn_layer_indices {bad} outside [0, {self.num_hidden_layers})")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r} not supported (only 'silu')")
        if problems:
            raise ModelConfigError("invalid bamba config: " + "; ".join(problems) + ". Fix the config.json values.")


def parse_bamba_config(cfg: Mapping[str, Any]) -> BambaModelConfig:
    """Normalize a Bamba config dict (HF ``BambaConfig.to_dict()`` or a ``config.json``).

    Raises:
        ModelConfigError: missing or inconsistent fields, unsupported RoPE scaling.
    """
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ModelConfigError(f"bamba config lacks {missing}: a config.json of the model is needed")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_size = int(cfg.get("head_dim") or hidden // heads)
    params = cfg.get("rope_parameters")
    # HF passes partial_rotary_factor=0.5 for Bamba; only rope_parameters can override it.
    partial = float(params.get("partial_rotary_factor", 0.5)) if isinstance(params, Mapping) else 0.5
    theta, scaling = parse_rope({k: v for k, v in cfg.items() if k != "partial_rotary_factor"})
    expand = int(cfg.get("mamba_expand", 2))
    n_heads = int(cfg.get("mamba_n_heads", 128))
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = expand * hidden // n_heads if d_head in (None, "auto") else int(d_head)
    limit = cfg.get("time_step_limit") or (0.0, math.inf)
    return BambaModelConfig(
        model_type="bamba",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_size=head_size,
        rotary_dim=int(head_size * partial),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 262144)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        attn_layer_indices=tuple(sorted(int(i) for i in (cfg.get("attn_layer_indices") or ()))),
        mamba_n_heads=n_heads,
        mamba_head_size=d_head,
        mamba_n_groups=int(cfg.get("mamba_n_groups", 1)),
        mamba_d_state=int(cfg.get("mamba_d_state", 256)),
        mamba_d_conv=int(cfg.get("mamba_d_conv", 4)),
        mamba_expand=expand,
        mamba_chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        time_step_limit=(float(limit[0]), float(limit[1])),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
    )
