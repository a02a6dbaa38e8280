"""``GptOssModelConfig``: HF ``GptOssForCausalLM`` configs, normalized.

gpt-oss is a Llama-family decoder (``DecoderModelConfig``'s fields) with:

* ``layer_types``: alternating ``sliding_attention`` (``sliding_window`` tokens, 128 in the
  released models) and ``full_attention`` layers (transformers' default: even layers slide);
* per-head attention sinks on every layer (``self_attn.sinks``, ``[num_attention_heads]``);
* q/k/v/o biases (``attention_bias``, default true);
* a mixture of experts on every layer (``moe_config.parse_moe(cfg, "gpt_oss")``: router with
  bias, top-k of the logits then softmax over those k, clamped SwiGLU experts with biases);
* YaRN RoPE (transformers' default ``rope_parameters``: factor 32, beta_fast 32, beta_slow 1,
  ``truncate`` false, ``original_max_position_embeddings`` 4096, theta 150000).

Facts from transformers 5.x ``configuration_gpt_oss.py`` / ``modeling_gpt_oss.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from attnplug.runner.models.config import DecoderModelConfig, ModelConfigError, parse_rope
from attnplug.runner.models.moe_config import MoEConfig, parse_moe

GPT_OSS_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
"""transformers' ``GptOssConfig`` RoPE when ``rope_parameters`` is absent."""


@dataclass(frozen=True)
class GptOssModelConfig(DecoderModelConfig):
    """A gpt-oss decoder.

    Attributes (beyond :class:`DecoderModelConfig`'s):
        moe: the mixture of experts every layer's MLP is.
    """

    moe: MoEConfig | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.moe is None:
            raise ModelConfigError("invalid gpt_oss config: no mixture-of-experts fields")


def _layer_windows(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window", 128)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ModelConfigError(f"gpt_oss layer_types {types!r} must list 'full_attention'/'sliding_attention' "
                               f"for each of the {num_layers} layers")
    if "sliding_attention" in types and window is None:
        raise ModelConfigError("gpt_oss layer_types has sliding_attention layers but sliding_window is null")
    return tuple(window if t == "sliding_attention" else None for t in types)


def parse_gpt_oss_config(cfg: Mapping[str, Any]) -> GptOssModelConfig:
    """Normalize a gpt-oss config dict (transformers' defaults where a field is absent).

    Raises:
        ModelConfigError: missing or invalid fields (named).
    """
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ModelConfigError(f"gpt_oss config lacks {missing}: a config.json of the model is needed")
    cfg = dict(cfg)
    if cfg.get("rope_parameters") is None and cfg.get("rope_scaling") is None:
        cfg["rope_parameters"] = dict(GPT_OSS_DEFAULT_ROPE, rope_theta=cfg.get("rope_theta", 150000.0))
    elif isinstance(cfg.get("rope_parameters"), Mapping) and "rope_theta" not in cfg["rope_parameters"]:
        cfg["rope_parameters"] = dict(cfg["rope_parameters"], rope_theta=cfg.get("rope_theta", 150000.0))
    num_layers, num_heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    theta, scaling = parse_rope(cfg)
    bias = bool(cfg.get("attention_bias", True))
    return GptOssModelConfig(
        model_type="gpt_oss", vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_size=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=bias, o_proj_bias=bias,
        mlp_bias=False, sliding_windows=_layer_windows(cfg, num_layers),
        initializer_range=float(cfg.get("initializer_range", 0.02)), hidden_act=str(cfg.get("hidden_act", "silu")),
        moe=parse_moe(cfg, "gpt_oss"))


__all__ = ["GPT_OSS_DEFAULT_ROPE", "GptOssModelConfig", "parse_gpt_oss_config"]
