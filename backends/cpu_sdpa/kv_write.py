"""``cpu_sdpa``'s paged K/V write in C (``_kv_write.pyx``), from torch tensors.

The same result as ``torch_native``'s :func:`~attnplug.backends.torch_native.attention.write_to_paged_cache`
(the golden reference) without its seven torch ops per call (slot division, two row
gathers, two advanced-index scatters): one C loop of ``memcpy`` per K and V row. It takes a
call when the cache is contiguous, the key / value rows are as the fused q/k/v projection
leaves them (each token's ``[num_kv_heads, head_size]`` contiguous) and their dtype is the
cache's (no fp8 quantisation); :func:`write` returns ``False`` otherwise and the caller runs
the torch write.
"""

from __future__ import annotations

import torch

from attnplug.core.errors import MetadataError

try:
    from attnplug.backends.cpu_sdpa import _kv_write
except ImportError:  # not compiled (no C compiler at install): the torch write runs
    _kv_write = None


def available() -> bool:
    """The compiled module was built and imports."""
    return _kv_write is not None


def write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
          token_indices: torch.Tensor) -> bool:
    """Write K/V rows ``token_indices`` of ``key`` / ``value`` at flat ``slots`` of the cache.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, the cache's dtype, CPU; each
            token's ``num_kv_heads * head_size`` elements contiguous (any token stride).
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``, contiguous, CPU.
        slots: ``[num_writes]`` ``torch.int64``, contiguous: flat slots ``block_id *
            block_size + offset``.
        token_indices: ``[num_writes]`` ``torch.int64``, contiguous: the row of ``key`` /
            ``value`` each slot receives.

    Returns:
        ``True`` when written; ``False`` (nothing written) when the module is not built or a
        tensor is outside the layouts above: the caller runs the torch write.

    Raises:
        MetadataError: a slot outside the cache or a token index outside ``key``'s rows
            (checked before anything is written: the cache is unchanged).
    """
    if not takes(key, value, kv_cache, slots, token_indices):
        return False
    write_taken(key, value, kv_cache, slots, token_indices)
    return True


def write_taken(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                token_indices: torch.Tensor) -> None:
    """:func:`write` for tensors :func:`takes` said yes to (or of the same dtypes, devices,
    shapes and strides: ``cpu_sdpa``'s impl asks once per step and layer geometry); the
    slots and token indices are still checked in C before anything is written.
    Raises ``MetadataError`` as :func:`write` does."""
    num_blocks, _, block_size, heads, head_size = kv_cache.shape
    size = key.element_size()
    n = slots.shape[0]
    bad = _kv_write.write_rows(key.data_ptr(), key.stride(0) * size, value.data_ptr(), value.stride(0) * size,
                               kv_cache.data_ptr(), block_size, num_blocks, heads * head_size * size,
                               slots.data_ptr(), token_indices.data_ptr(), n, key.shape[0])
    if bad >= 0:
        raise MetadataError(f"cpu_sdpa K/V write: write {bad} has slot {int(slots[bad])} (the cache has "
                            f"{num_blocks * block_size}) and token index {int(token_indices[bad])} (the step has "
                            f"{key.shape[0]} rows); the cache is unchanged")


def _rows_ok(x: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (x.dim() == 3 and x.device.type == "cpu" and x.dtype == kv_cache.dtype
            and x.shape[1:] == kv_cache.shape[3:] and x.stride(2) == 1 and x.stride(1) == x.shape[2])


def takes(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
          token_indices: torch.Tensor) -> bool:
    """The module is built and the tensors are in the layouts :func:`write` runs on (its
    docstring)."""
    return (_kv_write is not None and kv_cache.dim() == 5 and kv_cache.device.type == "cpu"
            and kv_cache.is_contiguous() and kv_cache.shape[1] == 2
            and _rows_ok(key, kv_cache) and _rows_ok(value, kv_cache)
            and key.shape[0] == value.shape[0]
            and slots.dtype == torch.int64 and token_indices.dtype == torch.int64
            and slots.dim() == 1 and slots.shape == token_indices.shape
            and slots.is_contiguous() and token_indices.is_contiguous()
            and slots.device.type == "cpu" and token_indices.device.type == "cpu")


__all__ = ["available", "takes", "write", "write_taken"]
