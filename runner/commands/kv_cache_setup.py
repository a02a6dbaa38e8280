"""``--kv-cache-dtype`` / ``--kv-scales`` / ``--kv-cache-memory``: the KV cache's dtype, where
an fp8 cache's scales come from, and a pool sized by bytes (``attnplug run`` and ``parity``).

``--kv-cache-dtype fp8_e4m3|fp8_e5m2`` stores every paged-K/V attention group (full and
sliding-window; not MLA, not Mamba) in one byte per element: each backend is selected for
layers that declare it (``AttentionBackend.supported_kv_cache_dtypes``; one that does not
is refused with its reasons), the group's spec carries the fp8 dtype (so its
``page_size_bytes`` and the blocks that fit a byte budget follow), and every attention layer
gets ``k_scale`` / ``v_scale`` from ``--kv-scales`` (``runner/models/kv_scales.py``).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from attnplug.cache_groups.kinds import GroupKind
from attnplug.cache_groups.specs import AttentionSpec, KVCacheSpec
from attnplug.core.errors import AttnplugError
from attnplug.core.kv_quant import KV_CACHE_DTYPES, kv_cache_dtype_name, parse_kv_cache_dtype
from attnplug.runner.models.kv_scales import KV_SCALE_SOURCES, attach_kv_scales

QUANTIZABLE_KINDS = (GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW)
"""Cache-group kinds ``--kv-cache-dtype`` quantises (paged K/V with ``num_kv_heads`` heads)."""


def add_flags(p: argparse.ArgumentParser, memory: bool = True) -> None:
    """Add ``--kv-cache-dtype``, ``--kv-scales`` (and ``--kv-cache-memory`` when ``memory``)."""
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache dtype: auto (the model's dtype) or fp8_e4m3 / fp8_e5m2 (1 byte per element, "
                        "per-tensor or per-KV-head scales; docs/configuration.md)")
    p.add_argument("--kv-scales", default="auto", choices=list(KV_SCALE_SOURCES),
                   help="fp8 caches: where k_scale / v_scale come from: checkpoint (the weights' "
                        "self_attn.k_scale / v_scale), first_batch (amax of the first step's K/V / fp8 max, then "
                        "frozen), unit (1.0), or auto (default: checkpoint when the weights carry them, else "
                        "first_batch)")
    if memory:
        from attnplug.runner.commands.limits import bounded_int

        p.add_argument("--kv-cache-memory", type=bounded_int(1, 2**20), default=None, metavar="MIB",
                       help="size every cache group's pool to fit this many MiB of KV cache in all (instead of "
                            "--num-blocks); with fp8 the same MiB hold 2x (vs 16-bit) or 4x (vs fp32) the blocks")


def flag_problem(args) -> str | None:
    """One line when ``--kv-scales`` names a source without an fp8 ``--kv-cache-dtype`` (the
    scales would go unused), else ``None``."""
    source = getattr(args, "kv_scales", "auto") or "auto"
    if source != "auto" and cache_dtype(args) is None:
        return (f"--kv-scales {source}: scales apply to an fp8 KV cache only; give --kv-cache-dtype fp8_e4m3 "
                "or fp8_e5m2, or drop --kv-scales")
    return None


def cache_dtype(args) -> torch.dtype | None:
    """The fp8 dtype ``args.kv_cache_dtype`` names, or ``None`` (``auto`` / absent)."""
    return parse_kv_cache_dtype(getattr(args, "kv_cache_dtype", None) or "auto")


def quantized_specs(specs: dict[str, KVCacheSpec], dtype: torch.dtype | None) -> dict[str, KVCacheSpec]:
    """``specs`` with every full / sliding-window attention spec's ``dtype`` set to ``dtype``
    (``None``: unchanged). The page size follows: ``2 * block_size * num_kv_heads *
    head_size * 1`` bytes for fp8."""
    if dtype is None:
        return specs
    return {name: dataclasses.replace(s, dtype=dtype) if isinstance(s, AttentionSpec) and s.kind in QUANTIZABLE_KINDS
            else s for name, s in specs.items()}


def prepare_scales(model: torch.nn.Module, args) -> dict[str, str] | None:
    """Attach ``k_scale`` / ``v_scale`` to every attention layer of ``model`` for an fp8
    cache (once: a model reused by a later engine keeps its scales); returns ``{"dtype",
    "scales", "granularity"}`` for the run's table (``scales``: where they came from, ``auto``
    resolved), ``None`` for ``auto``.

    Raises:
        AttnplugError: ``--kv-scales checkpoint`` without checkpoint scales for every layer.
    """
    dtype = cache_dtype(args)
    if dtype is None:
        return None
    if getattr(model, "attnplug_kv_scales", None) is None:
        backends = getattr(model, "attnplug_backends", {})
        per_head = {name: bool(getattr(b, "supports_per_head_kv_scales", False)) for name, b in backends.items()}
        quant_q = {name: bool(getattr(b, "supports_quant_query_input", False)) for name, b in backends.items()}
        source = getattr(args, "kv_scales", "auto") or "auto"
        try:
            sources = attach_kv_scales(model, dtype, source, per_head, quant_q)
        except ValueError as exc:  # --kv-scales checkpoint without (all) checkpoint scales
            raise AttnplugError(str(exc)) from None
        heads = {per_head.get(n, False) for n in sources}
        model.attnplug_kv_scales = {
            "dtype": kv_cache_dtype_name(dtype), "scales": next(iter(set(sources.values())), source),
            "granularity": "per KV head" if heads == {True} else "per tensor" if heads == {False} else "mixed"}
    return model.attnplug_kv_scales


def blocks_for_memory(specs_by_group: list[KVCacheSpec], layers_by_group: list[int], mib: int) -> int:
    """Blocks per cache group so that every group's pool (``num_blocks * page_size_bytes *
    layers``, one block count for all groups) fits ``mib`` MiB."""
    per_block = sum(s.page_size_bytes * n for s, n in zip(specs_by_group, layers_by_group))
    return max(2, (mib * 2**20) // per_block)


__all__ = ["add_flags", "blocks_for_memory", "cache_dtype", "flag_problem", "prepare_scales", "quantized_specs"]
