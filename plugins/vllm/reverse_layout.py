"""How a vLLM backend packs K and V, read from its own declarations, as attnplug's
:class:`~attnplug.core.kv_layout.KVCacheLayout` (for ``attnplug check vllm:NAME``).

vLLM 0.32 / 0.33 give every attention layer a *logical* cache ``[num_blocks, num_kv_heads,
block_size, C]`` whose physical order is a ``vllm.v1.kv_cache_layout.KVCacheLayout``
(``layer_view_order``: the physical order of those four logical dims); a backend declares the
orders its kernels read in ``supported_kv_cache_layouts()`` (most preferred first; ``None``:
any, vLLM then uses ``LBHNC``, the identity). The content ``C = 2 * head_size`` holds K's
``head_size`` values then V's: every vLLM backend that splits it does so with
``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` (``flex_attention.py``,
``flash_attn.py``, ``triton_attn.py``), so ``C`` is ``("kv", "dim")`` with ``kv`` outer.
Together they name the five dims of attnplug's descriptor in physical order: vLLM's
``LBNHC`` is attnplug's ``("block", "token", "head", "kv", "dim")``.

:data:`PACKING_OVERRIDES` lists the backends whose packing is *not* what their declarations
say: vLLM's CPU_ATTN declares ``LBHNC`` but its ``vec`` / ``vec16`` kernels write K transposed
inside each (block, head) slice (``reverse.KV_SPLITS``).
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug.core.kv_layout import KVCacheLayout

LOGICAL: tuple[str, ...] = ("block", "head", "token", "content")
"""vLLM's logical per-layer cache dims (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``)."""

CONTENT: tuple[str, ...] = ("kv", "dim")
"""The content dim as vLLM's backends split it: K's ``head_size`` values, then V's."""

PACKING_OVERRIDES: frozenset[str] = frozenset({"CPU_ATTN"})
"""Backends whose K/V packing their declarations do not describe (handled by name)."""


def declared_layout(vcls: Any) -> tuple[KVCacheLayout, str]:
    """attnplug's layout of vLLM backend class ``vcls``'s cache and the vLLM layout name it
    comes from (the first of ``supported_kv_cache_layouts()``, ``"LBHNC"`` when it declares
    none).

    Raises:
        ValueError: the declared layout does not order the four logical dims (a vLLM
            interface the bridge was not written for).
    """
    declared = vcls.supported_kv_cache_layouts()
    vlayout = declared[0] if declared else None
    order = tuple(vlayout.layer_view_order) if vlayout is not None else (0, 1, 2, 3)
    if sorted(order) != [0, 1, 2, 3]:
        raise ValueError(f"{vcls.get_name()}: KV cache layout {vlayout} does not order vLLM's four logical "
                         "cache dims")
    dims: list[str] = []
    for i in order:
        dims.extend(CONTENT if LOGICAL[i] == "content" else (LOGICAL[i],))
    return KVCacheLayout(dims=tuple(dims)), (vlayout.name if vlayout is not None else "LBHNC")


def vllm_view(kv_cache: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    """``kv_cache`` (attnplug's tensor in ``layout``) as vLLM's logical ``[num_blocks,
    num_kv_heads, block_size, 2 * head_size]`` view, sharing storage.

    Raises:
        RuntimeError: ``kv`` and ``dim`` are not adjacent in memory with ``kv`` outer, so no
            view merges them (``Tensor.view``'s error; no copy is ever made).
    """
    order = [layout.dims.index(d) for d in ("block", "head", "token", "kv", "dim")]
    five = kv_cache.permute(*order)
    return five.view(*five.shape[:3], -1)


def write_kv(layout: KVCacheLayout, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key`` / ``value`` (``[num_tokens, num_kv_heads, head_size]``) at
    ``slot_mapping`` (int64 ``[num_tokens]``: ``block * block_size + offset``; ``-1``
    skipped) into ``kv_cache`` (attnplug's tensor in ``layout``): the contract of vLLM's
    ``reshape_and_cache_flash`` (``csrc/cache_kernels.cu``), for where that compiled op is
    not loaded (vLLM 0.33's CUDA wheel on a CPU)."""
    k_cache, v_cache = layout.split(kv_cache)  # [num_blocks, block_size, num_kv_heads, head_size] views
    block_size = k_cache.shape[1]
    slots = slot_mapping[: key.shape[0]]
    keep = slots >= 0
    slots = slots[keep]
    k_cache[slots // block_size, slots % block_size] = key[keep].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = value[keep].to(v_cache.dtype)


def missing_compiled_op(exc: AttributeError) -> bool:
    """``exc`` says a vLLM compiled op (``torch.ops._C*``) is not loaded (not a bug)."""
    return "_OpNamespace" in str(exc) and "'_C" in str(exc)
