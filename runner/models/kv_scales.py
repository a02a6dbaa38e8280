"""Where an fp8 KV cache's scales come from, and the layer attributes that carry them.

A model with ``--kv-cache-dtype fp8_e4m3|fp8_e5m2`` gets, on every attention layer module
(not MLA, not Mamba), float32 buffers ``k_scale`` and ``v_scale`` (``core/kv_quant.py``:
shape ``[num_kv_heads]`` when the layer's backend declares ``supports_per_head_kv_scales``,
else ``[]``), read by the backend's impl at every forward. Their source, said in the run's
table (vLLM's three ways, ``docs/features/quantization/quantized_kvcache.md`` upstream):

* ``checkpoint``: the checkpoint's own (an fp8 checkpoint's ``model.layers.N.self_attn.k_scale``
  / ``v_scale`` tensors, vLLM's names; an older single ``kv_scale`` serves both), kept aside by
  ``weights.load_hf_state_dict`` (:func:`split_checkpoint_scales`) and set here;
* ``first_batch``: computed once, from the K and V of the first step that reaches the layer,
  as ``amax(|x|) / finfo(cache dtype).max`` (per KV head, or over all heads), then frozen;
* ``unit``: 1.0 (no calibration);
* ``auto`` (the default): ``checkpoint`` when the checkpoint carries scales for every attention
  layer, ``first_batch`` when it carries none (:func:`resolve_kv_scale_source`).

A checkpoint scale of another granularity than the layer's backend takes is converted: a
per-tensor scale is repeated over the KV heads; per-head scales for a per-tensor backend
become their maximum (no value saturates; small heads lose some precision). A checkpoint's
``q_scale`` becomes the layer's ``q_scale`` where the backend reads fp8 queries
(``supports_quant_query_input``; FA3), else it is not used (1.0 for every other source).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from attnplug.core.kv_quant import is_quantized

KV_SCALE_SOURCES: tuple[str, ...] = ("auto", "checkpoint", "first_batch", "unit")
"""``--kv-scales`` values."""

CHECKPOINT_SCALE_KEY = re.compile(r"^(?P<attn>.+\.self_attn)\.(?P<name>k_scale|v_scale|q_scale|kv_scale)$")
"""State-dict keys of an fp8 checkpoint's per-layer scales (vLLM's names)."""

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


def split_checkpoint_scales(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]
                            ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], list[str]]:
    """``(weights, scales, problems)``: ``state_dict`` without its fp8 scale tensors
    (:data:`CHECKPOINT_SCALE_KEY`), the scales as ``{attention module path: {"k_scale",
    "v_scale"[, "q_scale"]: float32 [] or [num_kv_heads]}}`` (``kv_scale`` sets both), and why
    a scale key cannot be used (not an attention module of ``model``, or a shape other than
    ``[]``, ``[1]`` or ``[num_kv_heads]``). Reads shapes and copies to float32 CPU; the model
    is not changed."""
    modules = dict(model.named_modules())
    weights, scales, problems = {}, {}, []
    for key, t in state_dict.items():
        m = CHECKPOINT_SCALE_KEY.match(key)
        if m is None:
            weights[key] = t
            continue
        attn = modules.get(m["attn"])
        heads = getattr(attn, "num_kv_heads", None)
        if not isinstance(heads, int) or not hasattr(attn, "impl"):
            problems.append(f"{key}: {m['attn']} is not a paged-K/V attention module of the model")
            continue
        if tuple(t.shape) not in ((), (1,), (heads,)):
            problems.append(f"{key}: shape {list(t.shape)}, need [] (per tensor) or [{heads}] (per KV head)")
            continue
        value = t.detach().to(device="cpu", dtype=torch.float32).reshape(() if t.numel() == 1 else (heads,))
        names = ("k_scale", "v_scale") if m["name"] == "kv_scale" else (m["name"],)
        for name in names:
            scales.setdefault(m["attn"], {})[name] = value.clone()
    return weights, scales, problems


def resolve_kv_scale_source(model: torch.nn.Module, requested: str) -> str:
    """The source ``--kv-scales requested`` means for ``model``: ``auto`` -> ``checkpoint``
    when ``model.attnplug_checkpoint_kv_scales`` holds ``k_scale`` and ``v_scale`` for every
    attention layer, ``first_batch`` when it holds none; any other value as given.

    Raises:
        ValueError: ``checkpoint`` (or ``auto``) with scales for some layers only, or
            ``checkpoint`` with none (the message names a layer without them).
    """
    if requested not in ("auto", "checkpoint"):
        return requested
    ckpt = getattr(model, "attnplug_checkpoint_kv_scales", None) or {}
    paths = _attention_paths(model)
    lacking = [p for p in paths.values() if not {"k_scale", "v_scale"} <= set(ckpt.get(p, {}))]
    if not lacking:
        return "checkpoint"
    if requested == "auto" and len(lacking) == len(paths):
        return "first_batch"
    raise ValueError(f"--kv-scales {requested}: the checkpoint carries k_scale / v_scale for "
                     f"{len(paths) - len(lacking)} of {len(paths)} attention layers (none for {lacking[0]}); "
                     "use --kv-scales first_batch or unit")


def _attention_paths(model: torch.nn.Module) -> dict[str, str]:
    """``{layer_name: module path}`` of :func:`attention_layers` (the path is the HF prefix)."""
    path_of = {id(m): p for p, m in model.named_modules()}
    return {name: path_of[id(m)] for name, m in attention_layers(model).items()}


def attach_kv_scales(model: torch.nn.Module, cache_dtype: torch.dtype, source: str,
                     per_head: Mapping[str, bool], quant_query: Mapping[str, bool] | None = None) -> dict[str, str]:
    """Give every attention layer ``k_scale`` / ``v_scale`` buffers (ones) for ``cache_dtype``.

    Args:
        model: the built model.
        cache_dtype: an fp8 dtype (``core/kv_quant.FP8_DTYPES``).
        source: one of :data:`KV_SCALE_SOURCES` (``auto`` resolved by
            :func:`resolve_kv_scale_source`); ``first_batch`` marks the layers for
            :func:`calibrate_once`; ``checkpoint`` copies the checkpoint's scales.
        per_head: ``{layer_name: bool}``: the layer's backend takes ``[num_kv_heads]`` scales.
        quant_query: ``{layer_name: bool}``: the layer's backend reads fp8 queries; such a
            layer gets the checkpoint's ``q_scale`` when it has one.

    Returns:
        ``{layer_name: source}``.

    Raises:
        ValueError: an unknown ``source`` or a dtype that is not fp8.
    """
    if source not in KV_SCALE_SOURCES:
        raise ValueError(f"kv scale source {source!r} is not one of {', '.join(KV_SCALE_SOURCES)}")
    if not is_quantized(cache_dtype):
        raise ValueError(f"{cache_dtype} is not an fp8 cache dtype: no scales")
    source = resolve_kv_scale_source(model, source)
    ckpt = getattr(model, "attnplug_checkpoint_kv_scales", None) or {}
    paths = _attention_paths(model)
    sources = {}
    for name, layer in attention_layers(model).items():
        device = next((p.device for p in layer.parameters()), torch.device("cpu"))
        shape = (layer.num_kv_heads,) if per_head.get(name, False) else ()
        given = ckpt.get(paths[name], {}) if source == "checkpoint" else {}
        for attr in ("k_scale", "v_scale"):
            value = _fitted(given[attr], shape) if attr in given else torch.ones(shape)
            layer.register_buffer(attr, value.to(device=device, dtype=torch.float32), persistent=False)
        if "q_scale" in given and (quant_query or {}).get(name, False):
            layer.register_buffer("q_scale", given["q_scale"].max().to(device), persistent=False)
        layer.kv_cache_dtype = cache_dtype
        layer.kv_scales_pending = source == "first_batch"
        sources[name] = source
    return sources


def _fitted(scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A checkpoint scale in the layer's granularity: ``[]`` repeated to ``[num_kv_heads]``,
    ``[num_kv_heads]`` to its maximum for a per-tensor backend (module docstring)."""
    if shape == ():
        return scale.max()
    return scale.expand(shape).clone() if scale.dim() == 0 else scale.clone()


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
