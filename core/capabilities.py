"""The capability vocabulary: what a backend declares, what a layer needs, in one place.

Selection (``plugins/selection.py``), ``attnplug backends`` and the generated feature
matrix (``docs/feature-matrix.md``, :func:`feature_matrix_markdown`) all read the same
words, so a capability cannot be declared in one place and forgotten in another. The set
follows what vLLM's backends declare today (``vllm/v1/attention/backend.py``:
``supports_sink``, ``supports_alibi_sqrt``, ``supports_non_causal``,
``supports_batch_invariance``, ``supported_kv_cache_dtypes``,
``supports_per_head_quant_scales``, ``supports_attn_type``, and the builders'
``AttentionCGSupport``).

Three kinds of words:

* :class:`Feature` — a yes/no capability of the attention math (sinks, ALiBi, a window...),
  declared by ``AttentionBackend.supports_*`` class methods and collected by
  ``AttentionBackend.features()``;
* :class:`ScaleGranularity` — how finely a quantized KV cache's scales may vary;
* :class:`BackendCapabilities` — one backend's whole declaration as data (features, dtypes,
  KV-cache dtypes, scale granularities, head sizes, kernel block sizes, devices, attention
  types, CUDA-graph level), made by :meth:`BackendCapabilities.of`.

A layer's needs are :func:`layer_needs` of its ``AttentionLayerConfig``; a backend that
lacks one is refused with one reason per missing feature (``validate_configuration``),
never silently degraded.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Feature(str, enum.Enum):
    """A yes/no capability of a backend's attention (the keys of ``AttentionBackend.features()``)."""

    SLIDING_WINDOW = "sliding_window"
    """Sliding-window layers (``sliding_window`` W tokens, current included)."""
    LOGITS_SOFT_CAP = "logits_soft_cap"
    """``cap * tanh(logits / cap)`` before the softmax (Gemma-2)."""
    MQA_GQA = "mqa_gqa"
    """Fewer KV heads than query heads."""
    SINKS = "sinks"
    """Per-head sink logits in the softmax denominator (gpt-oss; ``AttentionImpl(sinks=)``)."""
    ALIBI = "alibi"
    """ALiBi position biases (``-slope_h * distance``)."""
    ALIBI_SQRT = "alibi_sqrt"
    """ALiBi with ``sqrt(distance)`` (vLLM's ``supports_alibi_sqrt``)."""
    NON_CAUSAL = "non_causal"
    """Bidirectional attention within the paged decoder path (vLLM's ``supports_non_causal``)."""
    LSE_RETURN = "lse_return"
    """The impl can return each query row's log-sum-exp (context-parallel / cascade merges)."""
    BATCH_INVARIANT = "batch_invariant"
    """A request's output is bit-identical whatever else is in the batch."""


FEATURE_DESCRIPTIONS: dict[Feature, str] = {
    Feature.SLIDING_WINDOW: "sliding window",
    Feature.LOGITS_SOFT_CAP: "logits soft-cap",
    Feature.MQA_GQA: "GQA/MQA",
    Feature.SINKS: "attention sinks",
    Feature.ALIBI: "ALiBi",
    Feature.ALIBI_SQRT: "sqrt-ALiBi",
    Feature.NON_CAUSAL: "non-causal attention",
    Feature.LSE_RETURN: "LSE return",
    Feature.BATCH_INVARIANT: "batch invariance",
}
"""How reasons and tables name each feature."""


class ScaleGranularity(str, enum.Enum):
    """How finely the ``k_scale`` / ``v_scale`` of a quantized KV cache may vary."""

    PER_TENSOR = "per_tensor"
    """One float32 scale per layer for K and one for V (shape ``[]``)."""
    PER_HEAD = "per_head"
    """One float32 scale per KV head (shape ``[num_kv_heads]``)."""


def layer_needs(layer: Any) -> dict[Feature, str]:
    """The features an ``AttentionLayerConfig`` needs, each with how the layer uses it.

    ``{Feature.SINKS: "attention sinks (per-head sink logits)", ...}``; the text is what a
    refusal says (``"<text> not supported"``). GQA is left to the caller (its reason names
    the head counts). Reads attributes with ``getattr`` so older config objects work.
    """
    needs: dict[Feature, str] = {}
    window = getattr(layer, "sliding_window", None)
    if window is not None:
        needs[Feature.SLIDING_WINDOW] = f"sliding window ({window} tokens)"
    cap = getattr(layer, "logits_soft_cap", None)
    if cap is not None:
        needs[Feature.LOGITS_SOFT_CAP] = f"logits soft-cap ({cap})"
    if getattr(layer, "has_sinks", False):
        needs[Feature.SINKS] = "attention sinks (per-head sink logits)"
    if getattr(layer, "use_alibi_sqrt", False):
        needs[Feature.ALIBI_SQRT] = "sqrt-ALiBi position biases"
    elif getattr(layer, "use_alibi", False):
        needs[Feature.ALIBI] = "ALiBi position biases"
    if not getattr(layer, "causal", True):
        needs[Feature.NON_CAUSAL] = "non-causal attention"
    if getattr(layer, "batch_invariant", False):
        needs[Feature.BATCH_INVARIANT] = "batch-invariant attention"
    return needs


class FeatureDeclarations:
    """The ``supports_*`` class methods a backend overrides to declare a :class:`Feature`
    (vLLM's names where vLLM has them), and :meth:`features` collecting them. A base of
    ``AttentionBackend``; every default but GQA/MQA is ``False``.
    """

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        return False

    @classmethod
    def supports_mqa_gqa(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        """The impl applies ``sinks`` (vLLM's name; ``core/contracts.AttentionImpl``)."""
        return False

    @classmethod
    def supports_alibi(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        """Bidirectional attention in the paged decoder path (vLLM's name)."""
        return False

    @classmethod
    def supports_lse_return(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def features(cls) -> dict[str, bool]:
        """The ``supports_*`` claims as ``{Feature value: bool}``, one key per
        :class:`~attnplug.core.capabilities.Feature` (what the conformance suite tests,
        ``attnplug backends`` lists and the feature matrix shows)."""
        return {
            Feature.SLIDING_WINDOW.value: cls.supports_sliding_window(),
            Feature.LOGITS_SOFT_CAP.value: cls.supports_logits_soft_cap(),
            Feature.MQA_GQA.value: cls.supports_mqa_gqa(),
            Feature.SINKS.value: cls.supports_sink(),
            Feature.ALIBI.value: cls.supports_alibi(),
            Feature.ALIBI_SQRT.value: cls.supports_alibi_sqrt(),
            Feature.NON_CAUSAL.value: cls.supports_non_causal(),
            Feature.LSE_RETURN.value: cls.supports_lse_return(),
            Feature.BATCH_INVARIANT.value: cls.supports_batch_invariance(),
        }


def _dtype_name(d: Any) -> str:
    return str(d).replace("torch.", "")


@dataclass(frozen=True)
class BackendCapabilities:
    """One backend's declarations as plain data (what tables and the matrix show).

    Attributes:
        name: the registered name (``get_name()``).
        kv_cache_kind: ``"attention"``, ``"mla"``, ``"mamba"``...
        features: the :class:`Feature` values declared ``True``.
        dtypes: activation dtypes (``"float16"``...).
        kv_cache_dtypes: ``--kv-cache-dtype`` names (``"auto"``, ``"fp8_e4m3"``...),
            from ``supported_kv_cache_dtypes`` (``("auto",)`` when not declared).
        scale_granularities: how quantized-cache scales may vary; empty when no quantized
            KV-cache dtype is declared; per tensor always with one, per head when the
            backend sets ``supports_per_head_kv_scales``.
        head_sizes: accepted head sizes, ``None`` = any.
        kernel_block_sizes: kernel block sizes, ``None`` = any.
        devices: device types (``"cpu"``, ``"cuda"``).
        attn_types: ``AttentionType`` values (``"decoder"``...).
        cudagraph: the builder's ``AttentionCGSupport`` name (``"NEVER"``...), or ``"-"``
            when the backend has no attention builder to ask.
        quant_query: with an fp8 cache the impl reads fp8 queries too, scaled by the
            layer's ``q_scale`` (``supports_quant_query_input``; FA3).
    """

    name: str
    kv_cache_kind: str
    features: frozenset[Feature]
    dtypes: tuple[str, ...]
    kv_cache_dtypes: tuple[str, ...]
    scale_granularities: tuple[ScaleGranularity, ...]
    head_sizes: tuple[int, ...] | None
    kernel_block_sizes: tuple[int, ...] | None
    devices: tuple[str, ...]
    attn_types: tuple[str, ...]
    cudagraph: str
    quant_query: bool = False

    @classmethod
    def of(cls, backend_cls: Any) -> "BackendCapabilities":
        """The declarations of an ``AttentionBackend`` subclass (MLA and state backends too).

        Raises whatever the backend's declaration methods raise (callers that list
        third-party backends catch it).
        """
        declared = backend_cls.features()
        features = frozenset(f for f in Feature if declared.get(f.value, False))
        kv_dtypes = tuple(getattr(backend_cls, "supported_kv_cache_dtypes", ("auto",)))
        granularities: tuple[ScaleGranularity, ...] = ()
        if any(d != "auto" for d in kv_dtypes):
            granularities = (ScaleGranularity.PER_TENSOR,)
            if getattr(backend_cls, "supports_per_head_kv_scales", False):
                granularities += (ScaleGranularity.PER_HEAD,)
        heads = backend_cls.supported_head_sizes
        blocks = backend_cls.supported_kernel_block_sizes
        return cls(
            name=backend_cls.get_name(), kv_cache_kind=backend_cls.kv_cache_kind, features=features,
            dtypes=tuple(_dtype_name(d) for d in backend_cls.supported_dtypes), kv_cache_dtypes=kv_dtypes,
            scale_granularities=granularities, head_sizes=None if heads is None else tuple(heads),
            kernel_block_sizes=None if blocks is None else tuple(blocks),
            devices=tuple(backend_cls.supported_devices),
            attn_types=tuple(getattr(t, "value", str(t)) for t in backend_cls.supported_attn_types),
            cudagraph=_cudagraph_level(backend_cls),
            quant_query=bool(getattr(backend_cls, "supports_quant_query_input", False)) and bool(granularities))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: enums as their values, features as ``{name: bool}`` over every :class:`Feature`."""
        return {
            "name": self.name, "kv_cache_kind": self.kv_cache_kind,
            "features": {f.value: f in self.features for f in Feature},
            "dtypes": list(self.dtypes), "kv_cache_dtypes": list(self.kv_cache_dtypes),
            "scale_granularities": [g.value for g in self.scale_granularities],
            "head_sizes": None if self.head_sizes is None else list(self.head_sizes),
            "kernel_block_sizes": None if self.kernel_block_sizes is None else list(self.kernel_block_sizes),
            "devices": list(self.devices), "attn_types": list(self.attn_types), "cudagraph": self.cudagraph,
            "quant_query": self.quant_query,
        }


def _cudagraph_level(backend_cls: Any) -> str:
    """The builder's CUDA-graph level name, ``"-"`` when there is no builder to ask."""
    try:
        builder = backend_cls.get_builder_cls()
        level = builder.get_cudagraph_support(None)
    except (AttributeError, NotImplementedError, TypeError):
        return "-"
    return getattr(level, "name", str(level))
