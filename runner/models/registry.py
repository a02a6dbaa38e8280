"""Which HF architectures we implement, and how each family's config is read.

A config is matched by ``model_type`` first, then by ``architectures``. All three
Llama-family configs share one model class (``llama.DecoderModel``; Qwen3's subclasses it);
they differ in biases, q/k norms, MLPs and in which layers use a sliding window:

============  ======================  ==================================================
model_type    architectures           differences
============  ======================  ==================================================
``llama``     ``LlamaForCausalLM``    optional ``attention_bias`` (q/k/v/o), ``mlp_bias``
``qwen2``     ``Qwen2ForCausalLM``    q/k/v bias; window on layers ``>= max_window_layers``
                                      when ``use_sliding_window`` (or per ``layer_types``)
``mistral``   ``MistralForCausalLM``  ``sliding_window`` (may be null) on every layer
``qwen3``     ``Qwen3ForCausalLM``    q/k RMSNorm per head; windows as Qwen2
                                      (``Qwen3ModelConfig``, ``qwen3.py``)
``qwen3_moe`` ``Qwen3MoeForCausalLM`` Qwen3 + mixture-of-experts MLPs (``moe.py``),
                                      dense ``mlp_only_layers`` / ``decoder_sparse_step``
============  ======================  ==================================================

Families with their own model class and config:

===================  =============================  ========================================
``bamba``            ``BambaForCausalLM``           Mamba2 layers + attention at
                                                    ``attn_layer_indices`` (``bamba``)
``gemma3_text``      ``Gemma3ForCausalLM``          sliding and global layers interleaved,
                                                    Gemma norms and scaling (``gemma3``)
``attnplug_hybrid``  ``AttnplugHybridForCausalLM``  not an HF architecture: Bamba with some
                                                    attention layers windowed (``hybrid``);
                                                    the default ``attnplug run`` preset
``deepseek_v2``      ``DeepseekV2ForCausalLM``      multi-head latent attention (MLA cache
``deepseek_v3``      ``DeepseekV3ForCausalLM``      group) + MoE (``deepseek``)
``deepseek_v32``     ``DeepseekV32ForCausalLM``     V3 + sparse attention: an indexer cache
                                                    group, selector + sparse MLA
                                                    (``deepseek_v32``)
``gpt_oss``          ``GptOssForCausalLM``          sliding / full layers alternating, sinks,
                                                    MoE with clamped biased experts, YaRN
                                                    (``gpt_oss``)
``qwen3_next``       ``Qwen3NextForCausalLM``       Gated DeltaNet layers (GDN state group) +
                                                    gated attention, MoE with a shared expert
                                                    (``qwen3_next``)
``qwen3_5_text``     ``Qwen3_5ForCausalLM``         Qwen3.5 text: GDN + gated attention, dense
                                                    MLP (``qwen3_next``)
``qwen3_5_moe_text`` ``Qwen3_5MoeForCausalLM``      Qwen3.5-MoE text: Qwen3.5 with the MoE +
                                                    gated shared expert on every layer
                                                    (``qwen3_next``)
===================  =============================  ========================================

``qwen2_vl`` (``Qwen2VLForConditionalGeneration``): a vision tower + Qwen2 with M-RoPE
(``qwen2_vl``, ``qwen2_vl_vision``); images reach it as ``NewRequestData.mm_features``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from attnplug.runner.models.bamba_config import BambaModelConfig, parse_bamba_config
from attnplug.runner.models.deepseek_config import parse_deepseek_config
from attnplug.runner.models.deepseek_v32_config import parse_deepseek_v32_config
from attnplug.runner.models.gemma3_config import Gemma3ModelConfig, parse_gemma3_config
from attnplug.runner.models.gpt_oss_config import parse_gpt_oss_config
from attnplug.runner.models.hybrid import parse_hybrid_config
from attnplug.runner.models.qwen3_config import QWEN3_TYPES, Qwen3ModelConfig, qwen3_extras
from attnplug.runner.models.qwen3_next_config import parse_qwen3_next_config
from attnplug.runner.models.qwen2_vl_config import parse_qwen2_vl_config
from attnplug.runner.models.config import (
    DecoderModelConfig,
    ModelConfigError,
    load_config_dict,
    parse_rope,
)


class UnsupportedModelError(ModelConfigError):
    """The config's ``model_type`` / ``architectures`` name no family we implement.

    Attributes:
        model_type: the config's ``model_type`` (or ``None``).
        architectures: the config's ``architectures`` list.
        supported: the supported ``model_type`` -> architecture names.
    """

    def __init__(self, model_type: str | None, architectures: list[str]):
        self.model_type = model_type
        self.architectures = list(architectures)
        self.supported = {t: arch for t, (arch, _) in _FAMILIES.items()}
        self.supported.update({t: arch for t, (arch, _) in _HYBRIDS.items()})
        listing = ", ".join(f"{t} ({a})" for t, a in self.supported.items())
        super().__init__(
            f"unsupported model: model_type={model_type!r}, architectures={self.architectures!r}. "
            f"Supported: {listing}. Use a config of one of these architectures.")


UnsupportedModelError.__module__ = "attnplug"


def _windows_all_layers(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    return (cfg.get("sliding_window"),) * num_layers


def _windows_by_layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...] | None:
    types = cfg.get("layer_types")
    if types is None:
        return None
    if len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ModelConfigError(f"layer_types {types!r} must list 'full_attention'/'sliding_attention' "
                               f"for each of the {num_layers} layers")
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and window is None:
        raise ModelConfigError("layer_types has sliding_attention layers but sliding_window is null")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _qwen2_windows(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    by_types = _windows_by_layer_types(cfg, num_layers)
    if by_types is not None:
        return by_types
    if not cfg.get("use_sliding_window", False) or cfg.get("sliding_window") is None:
        return (None,) * num_layers
    first = cfg.get("max_window_layers", num_layers)
    return tuple(cfg["sliding_window"] if i >= first else None for i in range(num_layers))


def _llama_windows(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    return (None,) * num_layers


def _mistral_windows(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    return _windows_by_layer_types(cfg, num_layers) or _windows_all_layers(cfg, num_layers)


def _qwen3_moe_windows(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    if not cfg.get("use_sliding_window", False):
        return (None,) * num_layers
    return _windows_all_layers(cfg, num_layers)


_FAMILIES: dict[str, tuple[str, Callable[[Mapping[str, Any], int], tuple[int | None, ...]]]] = {
    "llama": ("LlamaForCausalLM", _llama_windows),
    "qwen2": ("Qwen2ForCausalLM", _qwen2_windows),
    "mistral": ("MistralForCausalLM", _mistral_windows),
    "qwen3": ("Qwen3ForCausalLM", _qwen2_windows),
    "qwen3_moe": ("Qwen3MoeForCausalLM", _qwen3_moe_windows),
}

_HYBRIDS: dict[str, tuple[str, Callable[[Mapping[str, Any]], Any]]] = {
    "bamba": ("BambaForCausalLM", parse_bamba_config),
    "gemma3_text": ("Gemma3ForCausalLM", parse_gemma3_config),
    "attnplug_hybrid": ("AttnplugHybridForCausalLM", parse_hybrid_config),
    "deepseek_v2": ("DeepseekV2ForCausalLM", lambda cfg: parse_deepseek_config(cfg, "deepseek_v2")),
    "deepseek_v3": ("DeepseekV3ForCausalLM", lambda cfg: parse_deepseek_config(cfg, "deepseek_v3")),
    "deepseek_v32": ("DeepseekV32ForCausalLM", lambda cfg: parse_deepseek_v32_config(cfg)),
    "gpt_oss": ("GptOssForCausalLM", parse_gpt_oss_config),
    "qwen3_next": ("Qwen3NextForCausalLM", parse_qwen3_next_config),
    "qwen3_5_text": ("Qwen3_5ForCausalLM", parse_qwen3_next_config),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", parse_qwen3_next_config),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", parse_qwen2_vl_config),
}
"""Hybrid families: model_type -> (architecture, parser of the config dict)."""

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILIES) + tuple(_HYBRIDS)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(arch for arch, _ in (*_FAMILIES.values(), *_HYBRIDS.values()))


def model_type_of(cfg: Mapping[str, Any]) -> str:
    """The family key of a config dict (by ``model_type``, else ``architectures``).

    Raises:
        UnsupportedModelError: neither names a supported family.
    """
    model_type = cfg.get("model_type")
    archs = list(cfg.get("architectures") or [])
    if model_type in _FAMILIES or model_type in _HYBRIDS:
        return model_type
    for t, (arch, _) in (*_FAMILIES.items(), *_HYBRIDS.items()):
        if arch in archs:
            return t
    raise UnsupportedModelError(model_type, archs)


def resolve_model_config(config: Any) -> DecoderModelConfig | Qwen3ModelConfig | BambaModelConfig | Gemma3ModelConfig:
    """Normalize an HF config of a supported architecture.

    Args:
        config: a ``PretrainedConfig``, a dict, a ``config.json`` path or its directory.

    Returns:
        The frozen :class:`DecoderModelConfig` (Llama family; its subclass
        :class:`~attnplug.runner.models.qwen3_config.Qwen3ModelConfig` for Qwen3 / Qwen3-MoE),
        :class:`~attnplug.runner.models.bamba_config.BambaModelConfig` (Bamba) or
        :class:`~attnplug.runner.models.gemma3_config.Gemma3ModelConfig` (Gemma3).

    Raises:
        UnsupportedModelError: not a Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mistral / Bamba / Gemma3 config.
        ModelConfigError: missing or invalid fields (named), unsupported RoPE scaling, a router
            kind not implemented, inconsistent expert counts.

    Examples:
        >>> cfg = resolve_model_config({"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32,
        ...     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        ...     "num_key_value_heads": 2})
        >>> cfg.head_size, cfg.qkv_bias, cfg.sliding_windows
        (8, True, (None, None))
    """
    cfg = load_config_dict(config)
    model_type = model_type_of(cfg)
    if model_type in _HYBRIDS:
        return _HYBRIDS[model_type][1](cfg)
    _, windows_of = _FAMILIES[model_type]
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ModelConfigError(f"{model_type} config lacks {missing}: a config.json of the model is needed")
    num_layers = int(cfg["num_hidden_layers"])
    num_heads = int(cfg["num_attention_heads"])
    head_size = cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads
    theta, scaling = parse_rope(cfg)
    attention_bias = bool(cfg.get("attention_bias", False))
    qwen3 = model_type in QWEN3_TYPES
    extras = qwen3_extras(cfg, model_type, num_layers) if qwen3 else {}
    return (Qwen3ModelConfig if qwen3 else DecoderModelConfig)(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_size=int(head_size),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_proj_bias=attention_bias if model_type in ("llama", *QWEN3_TYPES) else False,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
        sliding_windows=windows_of(cfg, num_layers),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        **extras,
    )
