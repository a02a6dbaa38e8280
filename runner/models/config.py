"""``DecoderModelConfig``: the normalized facts of a Llama-family HF config.

Hugging Face configs spell the same fact several ways across versions (``rope_theta`` at
the top level or inside ``rope_parameters``; ``rope_scaling`` with ``type`` or
``rope_type``; ``head_dim`` present, null or absent). The family parsers in
``registry.py`` read a plain dict with the helpers here and produce one frozen
:class:`DecoderModelConfig` the model is built from. ``transformers`` is not needed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping

from attnplug.core.errors import AttnplugError


class ModelConfigError(AttnplugError, ValueError):
    """A model config is unreadable, inconsistent, or uses a feature we do not implement."""


ModelConfigError.__module__ = "attnplug"


def is_positive_int(value: Any) -> bool:
    """``value`` is an ``int`` (``bool`` excluded) greater than 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def positive_int_problems(config: Any, names: Iterable[str], *, bool_ok: bool = False) -> list[str]:
    """One ``"<name> must be a positive int, got <value!r>"`` per attribute of ``config``
    named in ``names`` (in that order) that is not a positive int; ``[]`` when all are.

    ``bool_ok``: let ``True`` pass as 1 (the Llama-family and Bamba configs' check has
    always done so; the newer families' does not).
    """
    return [f"{name} must be a positive int, got {v!r}" for name in names
            if not (is_positive_int(v := getattr(config, name)) or (bool_ok and v is True))]

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
"""RoPE scaling types :func:`attnplug.runner.models.rope.rope_frequencies` implements."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_scaling`` / ``rope_parameters``); the formulas are in
    :func:`attnplug.runner.models.rope.rope_frequencies`.

    ``default``: none. ``linear``: positions divided by ``factor``. ``llama3``: long
    wavelengths divided by ``factor``, short ones kept, a smooth blend between
    (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
    ``yarn``: NTK-by-parts interpolation between ``beta_fast`` and ``beta_slow`` rotations
    over ``original_max_position_embeddings``, ``cos``/``sin`` multiplied by
    ``attention_factor`` (from ``mscale`` / ``mscale_all_dim`` when not given).
    ``partial_rotary_factor``: the fraction of each head's dimensions that is rotated (any
    type). ``interleaved``: DeepSeek's ``rope_interleave`` pairing ``(2i, 2i + 1)``.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0
    interleaved: bool = False


@dataclass(frozen=True)
class DecoderSizes:
    """The fields every decoder config starts with, in HF's names: ``model_type``;
    ``vocab_size`` (tokens), ``hidden_size``, ``intermediate_size`` (MLP width),
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` and ``head_size``
    (HF ``head_dim``), all ints > 0 once a family's ``__post_init__`` has checked
    :data:`SIZE_FIELDS` (:func:`positive_int_problems`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int

    SIZE_FIELDS: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads", "head_size")


@dataclass(frozen=True)
class DecoderModelConfig(DecoderSizes):
    """A Llama-family decoder (Llama, Qwen2, Mistral), normalized.

    ``head_size`` is HF ``head_dim`` (``hidden_size // num_attention_heads`` when absent).
    ``sliding_windows[i]`` is layer i's window W in tokens (current token included: key k
    visible to query p iff ``p - W < k <= p``), ``None`` for full attention.
    """

    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]
    initializer_range: float = 0.02
    hidden_act: str = "silu"

    def __post_init__(self):
        problems = positive_int_problems(self, (*self.SIZE_FIELDS, "max_position_embeddings"), bool_ok=True)
        if not problems and self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_size % 2:
            problems.append(f"head_dim {self.head_size} must be even for RoPE")
        problems += self._rope_problems()
        if len(self.sliding_windows) != self.num_hidden_layers:
            problems.append(f"{len(self.sliding_windows)} per-layer windows for {self.num_hidden_layers} layers")
        if any(w is not None and (not isinstance(w, int) or w <= 0) for w in self.sliding_windows):
            problems.append(f"sliding windows must be positive ints or None, got {sorted(set(self.sliding_windows), key=str)}")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r} not supported (only 'silu', the SwiGLU MLP)")
        if problems:
            raise ModelConfigError(f"invalid {self.model_type} config: " + "; ".join(problems)
                                   + ". Fix the config.json values.")

    def _rope_problems(self) -> list[str]:
        """What of ``rope_scaling`` this family cannot run: HF's Llama-family attention rotates
        whole heads with the half-split pairing (families with another rotary layout, e.g.
        DeepSeek's MLA, override this)."""
        problems = []
        if self.rope_scaling.partial_rotary_factor != 1.0:
            problems.append(f"partial_rotary_factor {self.rope_scaling.partial_rotary_factor!r} not supported by "
                            f"{self.model_type} (only 1.0)")
        if self.rope_scaling.interleaved:
            problems.append(f"rope_interleave is not supported by {self.model_type} (DeepSeek's pairing)")
        return problems


def load_config_dict(config: Any) -> dict[str, Any]:
    """Read a config given as a ``PretrainedConfig``, a mapping, or a path.

    Args:
        config: a ``transformers.PretrainedConfig`` (anything with ``to_dict()``), a
            mapping, a path to a ``config.json``, or a directory containing one.

    Returns:
        A plain dict copy.

    Raises:
        ModelConfigError: the file is missing or not a JSON object, or the type is unknown.
    """
    if hasattr(config, "to_dict") and callable(config.to_dict):
        return dict(config.to_dict())
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise ModelConfigError(f"cannot read model config {path!r}: {e.strerror}. "
                                   "Pass a config.json path or the model directory.") from None
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"model config {path!r} is not valid JSON ({e.msg} at line {e.lineno}).") from None
        if not isinstance(data, dict):
            raise ModelConfigError(f"model config {path!r} holds a JSON {type(data).__name__}, not an object.")
        return data
    raise ModelConfigError(f"cannot read a model config from a {type(config).__name__}: pass a "
                           "PretrainedConfig, a dict, or a path to config.json.")


def _number(params: Mapping[str, Any], key: str, default=None):
    v = params.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ModelConfigError(f"rope parameter {key} must be a number, got {v!r}")
    return float(v)


def _yarn(params: Mapping[str, Any], cfg: Mapping[str, Any], common: dict) -> RopeScaling:
    """YaRN's fields as HF reads them (``standardize_rope_params``, ``_compute_yarn_parameters``):
    ``original_max_position_embeddings`` from the top level of the config if there (Phi-3's
    spelling, which HF prefers), else from the rope parameters, else the config's
    ``max_position_embeddings``; a null ``factor`` is ``max_position_embeddings / original``."""
    original = cfg.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ModelConfigError(f"yarn rope scaling needs original_max_position_embeddings (a positive int), "
                               f"got {original!r}")
    factor = _number(params, "factor")
    if factor is None:
        factor = float(cfg.get("max_position_embeddings", original)) / original
    return RopeScaling("yarn", factor, original_max_position_embeddings=original,
                       beta_fast=_number(params, "beta_fast") or 32.0, beta_slow=_number(params, "beta_slow") or 1.0,
                       mscale=_number(params, "mscale"), mscale_all_dim=_number(params, "mscale_all_dim"),
                       attention_factor=_number(params, "attention_factor"),
                       truncate=bool(params.get("truncate", True)), **common)


def parse_rope(cfg: Mapping[str, Any], *, interleave_default: bool = False) -> tuple[float, RopeScaling]:
    """``(rope_theta, RopeScaling)`` from either HF spelling.

    transformers >= 5 puts everything in ``rope_parameters`` (``rope_theta`` and
    ``partial_rotary_factor`` included); older configs have them at the top level and an
    optional ``rope_scaling`` whose kind is ``rope_type`` or the legacy ``type``.
    ``rope_interleave`` (DeepSeek) is a top-level field; ``interleave_default`` is its value
    when absent (transformers' ``DeepseekV3Config`` defaults it to true).

    Raises:
        ModelConfigError: an unsupported scaling type, missing or non-numeric scaling fields,
            a ``partial_rotary_factor`` outside ``(0, 1]``.
    """
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ModelConfigError(f"rope parameters must be an object, got {params!r}")
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ModelConfigError(f"per-layer-type rope parameters ({sorted(params)}) are not supported "
                               "by the Llama family models")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(f"rope scaling type {rope_type!r} is not supported (supported: "
                               f"{', '.join(SUPPORTED_ROPE_TYPES)}); dynamic NTK would make logits "
                               "depend on the batch, so it is deliberately left out.")
    partial = _number(params, "partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    partial = 1.0 if partial is None else partial
    if not 0.0 < partial <= 1.0:
        raise ModelConfigError(f"partial_rotary_factor {partial!r} must be in (0, 1]")
    common = dict(partial_rotary_factor=partial, interleaved=bool(cfg.get("rope_interleave", interleave_default)))
    if rope_type == "default":
        return theta, RopeScaling(**common)
    if rope_type == "yarn":
        return theta, _yarn(params, cfg, common)
    if "factor" not in params:
        raise ModelConfigError(f"rope scaling {rope_type!r} needs a 'factor' (got {dict(params)!r})")
    scaling = RopeScaling(rope_type=rope_type, factor=float(params["factor"]), **common)
    if rope_type == "llama3":
        missing = [k for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in params]
        if missing:
            raise ModelConfigError(f"llama3 rope scaling needs {missing} (got {dict(params)!r})")
        scaling = RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                              float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]),
                              **common)
    return theta, scaling
