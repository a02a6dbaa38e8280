"""The ``k_scale`` / ``v_scale`` an impl uses for one forward (``core/kv_quant.py``).

Every built-in impl that reads fp8 caches calls :func:`kv_scales_for` once per forward, so a
scale of the wrong shape is refused in one place, with one message, before the cache is
written.
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug.core.errors import MetadataError
from attnplug.core.kv_quant import is_quantized, layer_kv_scales, scale_problems


def kv_scales_for(layer: Any, num_kv_heads: int, cache_dtype: torch.dtype,
                  where: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(k_scale, v_scale)`` of ``layer`` for a cache of ``cache_dtype``.

    Args:
        layer: the ``layer`` argument of ``forward`` (may be ``None``: scales 1.0).
        num_kv_heads: the impl's KV heads (a per-head scale has this many entries).
        cache_dtype: the cache's dtype; an unquantized cache uses no scales.
        where: names the caller in the error.

    Returns:
        ``(None, None)`` for an unquantized cache; else the layer's float32 ``[]`` or
        ``[num_kv_heads]`` tensors, ``None`` where the layer has none (1.0).

    Raises:
        MetadataError: a scale that is not a float32 tensor of shape ``[]`` or
            ``[num_kv_heads]``. Reads shapes only: no host sync.
    """
    if not is_quantized(cache_dtype):
        return None, None
    k_scale, v_scale = layer_kv_scales(layer)
    problems = scale_problems(k_scale, num_kv_heads, "k_scale") + scale_problems(v_scale, num_kv_heads, "v_scale")
    if problems:
        raise MetadataError(f"{where}: " + "; ".join(problems) + " (core/kv_quant.py)")
    return k_scale, v_scale
