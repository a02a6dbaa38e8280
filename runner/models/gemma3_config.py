"""``Gemma3ModelConfig``: the normalized facts of an HF ``Gemma3ForCausalLM`` config.

Field names and defaults follow transformers' ``Gemma3TextConfig`` (model_type
``"gemma3_text"``). Facts that differ from the Llama family:

* per-layer kinds: ``layer_types`` (``"sliding_attention"`` / ``"full_attention"``), or
  when absent every ``sliding_window_pattern``-th layer (default 6) is full attention:
  layer ``i`` slides iff ``(i + 1) % pattern != 0``;
* two RoPE tables: global (full-attention) layers use ``rope_theta`` (default 1e6) and
  ``rope_scaling``; local (sliding) layers use ``rope_local_base_freq`` (default 1e4), no
  scaling. transformers >= 5 writes both into ``rope_parameters`` keyed by layer type;
* attention scale ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``); optional
  ``final_logit_softcapping``; ``attn_logit_softcapping`` is kept but, as in transformers'
  Gemma3, never applied (see ``gemma3.py``);
* MLP activation ``hidden_activation = "gelu_pytorch_tanh"``; tied embeddings by default.

Bidirectional attention (``use_bidirectional_attention``, an embedding-model variant) is
not supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from attnplug.runner.models.config import (DecoderSizes, ModelConfigError, RopeScaling, parse_rope,
                                           positive_int_problems)

LAYER_KINDS = ("sliding_attention", "full_attention")
DEFAULT_SLIDING_WINDOW_PATTERN = 6


@dataclass(frozen=True)
class Gemma3ModelConfig(DecoderSizes):
    """A Gemma3 text decoder, normalized.

    ``layer_types[i]`` is ``"sliding_attention"`` or ``"full_attention"``;
    ``sliding_window`` is W tokens (current included) of the sliding layers.
    ``rope_theta`` / ``rope_scaling`` are the global (full-attention) layers' RoPE,
    ``rope_local_theta`` the sliding layers' (never scaled).
    """

    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    rope_local_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: tuple[str, ...]
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    initializer_range: float = 0.02
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Per layer ``W`` for sliding layers, ``None`` for full attention."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def attention_scale(self) -> float:
        """``query_pre_attn_scalar ** -0.5``: multiplies ``q . k``."""
        return float(self.query_pre_attn_scalar) ** -0.5

    def __post_init__(self):
        problems = positive_int_problems(self, (*self.SIZE_FIELDS, "max_position_embeddings", "sliding_window"))
        if not problems and self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")
        if isinstance(self.head_size, int) and self.head_size % 2:
            problems.append(f"head_dim {self.head_size} must be even for RoPE")
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_KINDS):
            problems.append(f"layer_types {list(self.layer_types)!r} must give one of {LAYER_KINDS} per layer "
                            f"({self.num_hidden_layers} layers)")
        if not self.query_pre_attn_scalar > 0:
            problems.append(f"query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar!r}")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                problems.append(f"{name} must be > 0 or null, got {v!r}")
        if self.hidden_act != "gelu_pytorch_tanh":
            problems.append(f"hidden_activation {self.hidden_act!r} not supported (only 'gelu_pytorch_tanh')")
        if problems:
            raise ModelConfigError("invalid gemma3_text config: " + "; ".join(problems) + ". Fix the config.json values.")


def _layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is not None:
        return tuple(types)
    pattern = cfg.get("sliding_window_pattern") or DEFAULT_SLIDING_WINDOW_PATTERN
    if not isinstance(pattern, int) or pattern <= 0:
        raise ModelConfigError(f"sliding_window_pattern must be a positive int, got {pattern!r}")
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def _ropes(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling, float]:
    """``(global theta, global scaling, local theta)`` from either HF spelling."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        unknown = set(params) - set(LAYER_KINDS)
        if unknown:
            raise ModelConfigError(f"rope_parameters has unknown layer types {sorted(unknown)} (known: {LAYER_KINDS})")
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", 1_000_000.0)
        local.setdefault("rope_theta", 10_000.0)
    else:  # transformers < 5: top-level theta, local base frequency, optional scaling of global layers
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    theta, scaling = parse_rope({"rope_parameters": full})
    local_theta, local_scaling = parse_rope({"rope_parameters": local})
    if local_scaling != RopeScaling():
        raise ModelConfigError(f"RoPE scaling of sliding layers ({local_scaling.rope_type}) is not supported; "
                               "Gemma3 scales only its global layers")
    return theta, scaling, local_theta


def parse_gemma3_config(cfg: Mapping[str, Any]) -> Gemma3ModelConfig:
    """Normalize an HF ``gemma3_text`` config dict.

    Raises:
        ModelConfigError: missing or invalid fields, bidirectional attention, unsupported
            RoPE scaling or activation.

    Examples:
        >>> c = parse_gemma3_config({"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32,
        ...     "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 2,
        ...     "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 5})
        >>> c.sliding_windows, c.rope_theta, c.rope_local_theta
        ((5, 5, 5, 5, 5, None), 1000000.0, 10000.0)
    """
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ModelConfigError(f"gemma3_text config lacks {missing}: a config.json of the model is needed")
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError("use_bidirectional_attention=True (Gemma3 embedding variant) is not supported: "
                               "attnplug serves causal decoders")
    num_layers = int(cfg["num_hidden_layers"])
    num_heads = int(cfg["num_attention_heads"])
    types = _layer_types(cfg, num_layers)
    window = cfg.get("sliding_window")
    if window is None:
        if "sliding_attention" in types:
            raise ModelConfigError("layer_types has sliding_attention layers but sliding_window is null")
        window = int(cfg.get("max_position_embeddings", 131_072))
    theta, scaling, local_theta = _ropes(cfg)
    softcap = cfg.get("final_logit_softcapping")
    attn_softcap = cfg.get("attn_logit_softcapping")
    return Gemma3ModelConfig(
        model_type="gemma3_text",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_size=int(cfg.get("head_dim") or 256),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131_072)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        sliding_window=int(window),
        layer_types=types,
        final_logit_softcapping=None if softcap is None else float(softcap),
        attn_logit_softcapping=None if attn_softcap is None else float(attn_softcap),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"),
    )
