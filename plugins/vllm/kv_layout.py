"""The KV cache vLLM 0.32 allocates, seen zero-copy in an attnplug backend's layout.

vLLM 0.32 no longer asks a backend for a cache shape (``get_kv_cache_shape`` is gone):
every layer's cache is a logical 4-D tensor ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` whose physical order is one :class:`KVCacheLayout` chosen for the whole
model from what each backend declares (``supported_kv_cache_layouts``). The bridge
declares the *block-compact* layouts (``LBHNC``, ``LBNHC``: layer and block outermost),
for which each block's ``2 * block_size * num_kv_heads * head_size`` elements are one
contiguous run. Within that run the bridge owns the order: it re-reads the run in the
attnplug backend's ``get_kv_cache_shape`` (e.g. ``[num_blocks, 2, block_size,
num_kv_heads, head_size]``) with ``torch.as_strided`` -- no copy, same storage. This is
sound because only the attention backend reads or writes a block's interior (vLLM's
allocator, prefix cache and block tables deal in whole blocks); KV connectors, which
would read interiors in vLLM's own order, are not supported by the bridge.
"""

from __future__ import annotations

import math

import torch

from attnplug.core.errors import BackendUnsupportedError


def layout_problem(backend: type, block_size: int, num_kv_heads: int, head_size: int) -> str | None:
    """Why ``backend``'s ``get_kv_cache_shape`` cannot be laid over vLLM's blocks (``None``:
    it can): it must put blocks outermost and hold exactly the K and V of a block in each."""
    shape = tuple(backend.get_kv_cache_shape(7, block_size, num_kv_heads, head_size))
    if shape[0] != 7 or math.prod(shape[1:]) != 2 * block_size * num_kv_heads * head_size:
        return (f"its KV cache shape {shape} (for 7 blocks) does not put num_blocks first with one block's K "
                f"and V ({2 * block_size * num_kv_heads * head_size} elements) behind it, so it cannot be laid "
                "over vLLM's block-compact cache without a copy")
    return None


def _block_compact(kv_cache: torch.Tensor) -> bool:
    """Dims 1..3 are a permutation of one contiguous run, and blocks follow each other."""
    run = 1
    for stride, size in sorted(zip(kv_cache.stride()[1:], kv_cache.shape[1:])):
        if size > 1 and stride != run:
            return False
        run *= size
    return kv_cache.shape[0] <= 1 or kv_cache.stride(0) == run


def attnplug_view(kv_cache: torch.Tensor, backend: type, num_kv_heads: int, head_size: int) -> torch.Tensor:
    """``kv_cache`` (vLLM's per-layer ``[num_blocks, num_kv_heads, block_size, 2 *
    head_size]``, block-compact) as ``backend.get_kv_cache_shape(...)``, sharing storage.

    Raises:
        BackendUnsupportedError: the cache is not block-compact (a layout the bridge did
            not declare) or its sizes disagree with the layer's.
    """
    num_blocks, heads, block_size, content = kv_cache.shape
    if heads != num_kv_heads or content != 2 * head_size:
        raise BackendUnsupportedError(backend.get_name(), [
            f"vLLM's KV cache {tuple(kv_cache.shape)} does not match the layer ({num_kv_heads} KV heads of "
            f"{head_size})"], context="the vLLM bridge")
    if not _block_compact(kv_cache):
        raise BackendUnsupportedError(backend.get_name(), [
            f"vLLM's KV cache strides {kv_cache.stride()} are not block-compact (each block one contiguous "
            "run); the bridge declares only LBHNC and LBNHC"], context="the vLLM bridge")
    shape = tuple(backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return torch.as_strided(kv_cache, shape, strides, kv_cache.storage_offset())
