"""Where an fp8 KV cache's scales come from, and the layer attributes that carry them.

A model with ``--kv-cache-dtype fp8_e4m3|fp8_e5m2`` gets, on every attention layer module
(not MLA, not Mamba), float32 buffers ``k_scale`` and ``v_scale`` (``core/kv_quant.py``:
shape ``[num_kv_heads]`` when the layer's backend declares ``supports_per_head_kv_scales``,
else ``[]``), read by the backend's impl at every forward. Their source, said in the run's
table (vLLM's three ways, ``docs/features/quantization/quantized_kvcache.md`` upstream):

* ``first_batch``: computed once, from the K and V of the first step that reaches the layer,
  as ``amax(|x|) / finfo(cache dtype).max`` (per KV head, or over all heads), then frozen;
* ``unit``: 1.0 (no calibration).

Scales stored in a checkpoint (an fp8 checkpoint's ``self_attn.k_scale`` / ``v_scale``) are
not read yet: neither bundled model has them.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from attnplug.core.kv_quant import is_quantized

KV_SCALE_SOURCES: tuple[str, ...] = ("first_batch", "unit")
"""``--kv-scales`` values."""

MIN_SCALE: float = 1e-8
"""Floor of a computed scale (an all-zero head would otherwise give 0 and divide by it)."""

FIRST_BATCH_HEADROOM: float = 4.0
"""A first-batch scale covers this many times the batch's amax: later tokens often exceed the
first batch's (RoPE rotates K into dimensions the first positions barely used), and a value
past the range saturates, while fp8's exponent keeps the relative precision of smaller
values whatever the scale (only values below ``scale * 2^-6`` (e4m3) become subnormal)."""


def attention_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{layer_name: module}`` of the model's paged-K/V attention layers: modules with a
    ``layer_name``, an ``impl`` and ``num_kv_heads`` (MLA and Mamba layers have no
    ``num_kv_heads`` K/V heads to scale)."""
    out = {}
    for module in model.modules():
        name = getattr(module, "layer_name", None)
        if isinstance(name, str) and hasattr(module, "impl") and isinstance(getattr(module, "num_kv_heads", None), int) \
                and not hasattr(module, "kv_lora_rank"):
            out[name] = module
    return out


def attach_kv_scales(model: torch.nn.Module, cache_dtype: torch.dtype, source: str,
                     per_head: Mapping[str, bool]) -> dict[str, str]:
    """Give every attention layer ``k_scale`` / ``v_scale`` buffers (ones) for ``cache_dtype``.

    Args:
        model: the built model.
        cache_dtype: an fp8 dtype (``core/kv_quant.FP8_DTYPES``).
        source: one of :data:`KV_SCALE_SOURCES`; ``first_batch`` marks the layers for
            :func:`calibrate_once`.
        per_head: ``{layer_name: bool}``: the layer's backend takes ``[num_kv_heads]`` scales.

    Returns:
        ``{layer_name: source}``.

    Raises:
        ValueError: an unknown ``source`` or a dtype that is not fp8.
    """
    if source not in KV_SCALE_SOURCES:
        raise ValueError(f"kv scale source {source!r} is not one of {', '.join(KV_SCALE_SOURCES)}")
    if not is_quantized(cache_dtype):
        raise ValueError(f"{cache_dtype} is not an fp8 cache dtype: no scales")
    sources = {}
    for name, layer in attention_layers(model).items():
        device = next((p.device for p in layer.parameters()), torch.device("cpu"))
        shape = (layer.num_kv_heads,) if per_head.get(name, False) else ()
        layer.register_buffer("k_scale", torch.ones(shape, dtype=torch.float32, device=device), persistent=False)
        layer.register_buffer("v_scale", torch.ones(shape, dtype=torch.float32, device=device), persistent=False)
        layer.kv_cache_dtype = cache_dtype
        layer.kv_scales_pending = source != "unit"
        sources[name] = source
    return sources


def calibrate_once(layer: Any, key: torch.Tensor, value: torch.Tensor) -> None:
    """If ``layer`` is still pending calibration, set its scales from this batch and freeze them.

    ``key`` / ``value``: ``[num_tokens, num_kv_heads, head_size]`` (this step's, before the
    cache write). ``scale = max(FIRST_BATCH_HEADROOM * amax(|x|) / finfo.max, MIN_SCALE)``
    per KV head (a ``[num_kv_heads]`` buffer) or over every head (``[]``). No host sync.
    """
    if not getattr(layer, "kv_scales_pending", False) or key.shape[0] == 0:
        return
    big = torch.finfo(layer.kv_cache_dtype).max
    for x, buf in ((key, layer.k_scale), (value, layer.v_scale)):
        amax = x.detach().float().abs().amax(dim=(0, 2)) if buf.dim() == 1 else x.detach().float().abs().amax()
        buf.copy_((FIRST_BATCH_HEADROOM * amax / big).clamp_min(MIN_SCALE))
    layer.kv_scales_pending = False
