"""``Qwen3NextModelConfig``: HF ``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM`` and
``Qwen3_5MoeForCausalLM`` (text) configs.

Both families interleave Gated DeltaNet layers (``"linear_attention"``) with gated full
attention (``"full_attention"``); layer ``i``'s kind is ``layer_types[i]``, or, without
``layer_types``, full attention iff ``(i + 1) % full_attention_interval == 0`` (default 4:
three GDN layers, then one attention layer; transformers' ``Qwen3NextConfig``).

Attention: ``q_proj`` gives a query and an output gate per head, RMSNorm ``(1 + weight)``
on q and k per head, RoPE on the first ``partial_rotary_factor * head_dim`` dimensions
(``rope_parameters``; default 0.25), ``o_proj(attn * sigmoid(gate))``.

Qwen3-Next's MLP is a mixture of experts (softmax router, top-k, renormalised when
``norm_topk_prob``) plus one shared SwiGLU expert of ``shared_expert_intermediate_size``
scaled by ``sigmoid(shared_expert_gate(x))``, on layers ``i`` not in ``mlp_only_layers``
with ``(i + 1) % decoder_sparse_step == 0``; Qwen3.5 (dense) has a SwiGLU MLP everywhere;
Qwen3.5-MoE has the mixture of experts with the gated shared expert on every layer, its
router always renormalising the top-k weights (transformers' ``Qwen3_5MoeTopKRouter``; the
config has no ``norm_topk_prob``, ``decoder_sparse_step`` or dense ``intermediate_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from attnplug.runner.models.config import DecoderSizes, ModelConfigError, RopeScaling, is_positive_int, parse_rope
from attnplug.runner.models.moe_config import MoEConfig, parse_moe, sparse_layers

QWEN3_NEXT_TYPES: dict[str, str] = {"qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5",
                                    "qwen3_5_moe_text": "qwen3_5"}
"""model_type -> GDN projection layout (``runner.models.gdn.PROJECTION_LAYOUTS``)."""
LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen3NextModelConfig(DecoderSizes):
    """A Qwen3-Next or Qwen3.5 text decoder, normalized (field names as HF's config; sizes
    checked as HF's config is read, by :func:`parse_qwen3_next_config`)."""

    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    moe: MoEConfig | None = None
    sparse_layers: tuple[bool, ...] = ()
    shared_expert_intermediate_size: int = 0

    @property
    def gdn_layout(self) -> str:
        """The GDN projection layout (``"qwen3_next"`` or ``"qwen3_5"``)."""
        return QWEN3_NEXT_TYPES[self.model_type]


def layer_types_of(cfg: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """``layer_types`` (validated), else from ``full_attention_interval`` (default 4).

    Raises:
        ModelConfigError: a wrong length, an unknown kind, or an interval < 1.
    """
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ModelConfigError(f"full_attention_interval must be an int >= 1, got {interval!r}")
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))
    if not isinstance(types, (list, tuple)) or len(types) != num_layers or not set(types) <= set(LAYER_KINDS):
        raise ModelConfigError(f"layer_types {types!r} must list one of {list(LAYER_KINDS)} for each of the "
                               f"{num_layers} layers")
    return tuple(types)


def _positive(cfg: Mapping[str, Any], key: str, default: Any = None) -> int:
    v = cfg.get(key, default)
    if not is_positive_int(v):
        raise ModelConfigError(f"{cfg.get('model_type')} config: {key} must be a positive int, got {v!r}")
    return v


def _moe_fields(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    model_type = cfg.get("model_type")
    if model_type == "qwen3_5_moe_text":  # every layer sparse, the top-k weights always renormalised
        return {"moe": parse_moe({**cfg, "norm_topk_prob": True}, "qwen3_moe"), "sparse_layers": (True,) * num_layers,
                "shared_expert_intermediate_size": _positive(cfg, "shared_expert_intermediate_size")}
    if model_type != "qwen3_next" or not cfg.get("num_experts", 0):
        return {"moe": None, "sparse_layers": (False,) * num_layers}
    sparse = sparse_layers(num_layers, mlp_only_layers=cfg.get("mlp_only_layers") or (),
                           decoder_sparse_step=cfg.get("decoder_sparse_step", 1))
    return {"moe": parse_moe(cfg, "qwen3_moe"), "sparse_layers": sparse,
            "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)}


def parse_qwen3_next_config(cfg: Mapping[str, Any]) -> Qwen3NextModelConfig:
    """Normalize a ``qwen3_next``, ``qwen3_5_text`` or ``qwen3_5_moe_text`` config dict.

    Raises:
        ModelConfigError: a missing or non-positive size (named), bad ``layer_types``,
            ``linear_num_value_heads`` not a multiple of ``linear_num_key_heads``, an
            unsupported RoPE or MoE field.
    """
    model_type = cfg.get("model_type")
    if model_type not in QWEN3_NEXT_TYPES:
        raise ModelConfigError(f"not a Qwen3-Next / Qwen3.5 text config: model_type {model_type!r}")
    n = _positive(cfg, "num_hidden_layers")
    heads = _positive(cfg, "num_attention_heads")
    if model_type == "qwen3_5_moe_text":  # no dense MLP: the field only sizes the (unused) dense width
        cfg = {**cfg, "intermediate_size": cfg.get("intermediate_size") or _positive(cfg, "moe_intermediate_size")}
    sizes = {k: _positive(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                           "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                           "linear_value_head_dim")}
    if sizes["linear_num_value_heads"] % sizes["linear_num_key_heads"]:
        raise ModelConfigError(f"linear_num_value_heads {sizes['linear_num_value_heads']} is not a multiple of "
                               f"linear_num_key_heads {sizes['linear_num_key_heads']}")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ModelConfigError(f"hidden_act {cfg.get('hidden_act')!r} not supported (the GDN conv and MLP use silu)")
    rope = cfg.get("rope_parameters") or {}
    if "partial_rotary_factor" not in cfg and "partial_rotary_factor" not in rope:
        cfg = {**cfg, "partial_rotary_factor": 0.25}   # transformers' default for these families
    theta, scaling = parse_rope(cfg)
    return Qwen3NextModelConfig(
        model_type=model_type, num_hidden_layers=n, num_attention_heads=heads,
        num_key_value_heads=_positive(cfg, "num_key_value_heads", heads),
        head_size=_positive(cfg, "head_dim", sizes["hidden_size"] // heads),
        layer_types=layer_types_of(cfg, n), linear_conv_kernel_dim=_positive(cfg, "linear_conv_kernel_dim", 4),
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), attention_bias=bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        initializer_range=float(cfg.get("initializer_range", 0.02)), hidden_act="silu",
        **sizes, **_moe_fields(cfg, n))


__all__ = ["LAYER_KINDS", "QWEN3_NEXT_TYPES", "Qwen3NextModelConfig", "layer_types_of", "parse_qwen3_next_config"]
