"""Quantized KV caches: the cache dtypes, the scales, and the two conversions every backend
shares (scale-aware write, dequantising read).

Conventions (vLLM's ``docs/features/quantization/quantized_kvcache.md``; FA3's and
FlashInfer's fp8 arguments follow the same meaning):

* A cache holds ``stored = saturate(x / scale)`` in the cache dtype; the real value is
  ``stored * scale`` (so ``scale`` is a *descale* factor, FA3's ``k_descale``).
* ``k_scale`` / ``v_scale`` are float32 tensors of shape ``[]`` (per tensor) or
  ``[num_kv_heads]`` (per KV head), one pair per attention layer, carried by the layer
  module as attributes ``k_scale`` and ``v_scale`` (the ``layer`` argument of
  ``AttentionImpl.forward``). A layer without them, or ``layer=None``, means scale 1.0.
* Saturation: values beyond the dtype's finite range are clamped to ``±finfo.max`` before the
  cast (448 for e4m3fn, 57344 for e5m2); a plain cast would give NaN (e4m3fn) or inf (e5m2).

Names (``--kv-cache-dtype``): ``auto`` (the model's dtype), ``fp8_e4m3``
(``torch.float8_e4m3fn``), ``fp8_e5m2`` (``torch.float8_e5m2``), vLLM's ``CacheDType`` names.
"""

from __future__ import annotations

from typing import Any

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""``--kv-cache-dtype`` name -> cache dtype (``None``: the model's dtype)."""

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The quantized cache dtypes: a cache in one of these needs scales."""


def kv_cache_dtype_name(dtype: torch.dtype | None) -> str:
    """The ``--kv-cache-dtype`` name of a cache dtype (``auto`` for ``None`` or an unquantized
    dtype)."""
    for name, d in KV_CACHE_DTYPES.items():
        if d is not None and d == dtype:
            return name
    return "auto"


def parse_kv_cache_dtype(name: str) -> torch.dtype | None:
    """``"fp8_e4m3"`` -> ``torch.float8_e4m3fn``; ``"auto"`` -> ``None``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def is_quantized(dtype: torch.dtype) -> bool:
    """True for the fp8 cache dtypes (a cache that needs scales)."""
    return dtype in FP8_DTYPES


def _per_head(scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``scale`` (``[]`` or ``[num_kv_heads]``) shaped to broadcast over ``like``
    (``[..., num_kv_heads, head_size]``), float32, on ``like``'s device."""
    s = scale.to(device=like.device, dtype=torch.float32)
    return s.view(-1, 1) if s.dim() == 1 else s


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as stored in a cache of ``cache_dtype``: ``saturate(x / scale)`` cast to it.

    Args:
        x: ``[..., num_kv_heads, head_size]``, any float dtype.
        scale: float32 ``[]`` or ``[num_kv_heads]``, or ``None`` (1.0). Ignored for an
            unquantized ``cache_dtype`` (a plain cast, as before).
        cache_dtype: the cache's dtype.

    Returns:
        A tensor of ``x``'s shape in ``cache_dtype``. Never synchronises with the host.
    """
    if not is_quantized(cache_dtype):
        return x.to(cache_dtype)
    y = x.float()
    if scale is not None:
        y = y / _per_head(scale, x)
    big = torch.finfo(cache_dtype).max
    return y.clamp(-big, big).to(cache_dtype)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The real values of cache entries: ``stored * scale`` in ``out_dtype``.

    Args:
        stored: ``[..., num_kv_heads, head_size]`` in the cache dtype.
        scale: float32 ``[]`` or ``[num_kv_heads]``, or ``None`` (1.0); ignored when
            ``stored`` is not fp8.
        out_dtype: the compute dtype (float32 in the reference backends).
    """
    if not is_quantized(stored.dtype):
        return stored.to(out_dtype)
    y = stored.float()
    if scale is not None:
        y = y * _per_head(scale, stored)
    return y.to(out_dtype)


def layer_kv_scales(layer: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(k_scale, v_scale)`` carried by an attention layer module, ``None`` where absent.

    Args:
        layer: the ``layer`` argument of ``AttentionImpl.forward`` (may be ``None``).
    """
    if layer is None:
        return None, None
    return getattr(layer, "k_scale", None), getattr(layer, "v_scale", None)


def scale_problems(scale: Any, num_kv_heads: int, name: str) -> list[str]:
    """Reasons ``scale`` is not a valid ``k_scale`` / ``v_scale`` (empty: fine).

    Valid: ``None``, or a float32 tensor of shape ``[]`` or ``[num_kv_heads]``. Reads the
    shape and dtype only (no host sync).
    """
    if scale is None:
        return []
    if not isinstance(scale, torch.Tensor):
        return [f"{name} is a {type(scale).__name__}, not a float32 tensor"]
    if scale.dtype != torch.float32 or tuple(scale.shape) not in ((), (num_kv_heads,)):
        return [f"{name} is {scale.dtype} {tuple(scale.shape)}; need float32 [] (per tensor) or "
                f"[{num_kv_heads}] (per KV head)"]
    return []


def per_head_scales(scale: torch.Tensor | None, num_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """``scale`` as a contiguous float32 ``[num_kv_heads]`` tensor on ``device`` (what kernels
    index by KV head, FA3's ``k_descale`` row): ``None`` -> ones, ``[]`` -> repeated. No
    host sync."""
    if scale is None:
        return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    s = scale.to(device=device, dtype=torch.float32)
    return s.expand(num_kv_heads).contiguous() if s.dim() == 0 else s.contiguous()


def layer_q_scale(layer: Any) -> torch.Tensor | None:
    """The ``q_scale`` an attention layer module carries (``None`` where absent or
    ``layer=None``: 1.0). Read only by backends that declare ``supports_quant_query_input``
    (their impl quantizes the query to the cache's fp8 dtype; FA3)."""
    return None if layer is None else getattr(layer, "q_scale", None)


def quantize_query(query: torch.Tensor, q_scale: torch.Tensor | None, num_kv_heads: int,
                   cache_dtype: torch.dtype) -> torch.Tensor:
    """``query`` ``[num_tokens, num_heads, head_size]`` stored as ``saturate(q / q_scale)`` in
    ``cache_dtype`` (fp8), ``q_scale`` float32 ``[]`` or ``[num_kv_heads]`` (query head ``h``
    uses its KV head's, ``h // (num_heads // num_kv_heads)``) or ``None`` (1.0). No host sync."""
    if q_scale is not None and q_scale.dim() == 1:
        q_scale = q_scale.repeat_interleave(query.shape[1] // num_kv_heads)
    return quantize_kv(query, q_scale, cache_dtype)


def kv_cache_dtype_problems(backend_cls: Any, kv: torch.dtype) -> list[str]:
    """A quantized cache dtype ``kv`` that ``backend_cls`` does not list in
    ``supported_kv_cache_dtypes`` (one reason; empty: fine). Part of the base
    ``AttentionBackend.validate_configuration``."""
    declared = tuple(getattr(backend_cls, "supported_kv_cache_dtypes", ("auto",)))
    if is_quantized(kv) and kv_cache_dtype_name(kv) not in declared:
        return [f"kv_cache_dtype {kv_cache_dtype_name(kv)} not supported (supported: {', '.join(declared)})"]
    return []
