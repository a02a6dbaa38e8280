"""Paged KV-cache write and GPU slot mapping: Python entry points of ``cache_kernels.py``.

Both launch one Triton kernel, never synchronise with the host and may be captured in a
CUDA graph (their launch shapes depend only on tensor shapes and Python ints).
"""

from __future__ import annotations

import torch

from attnplug.backends.triton.runtime import interpreting, kernel_module, launch
from attnplug.backends.common.value_checks import check_slots, values_checked
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.errors import MetadataError
from attnplug.core.kv_quant import is_quantized, per_head_scales

WRITE_ELEMENTS_PER_PROGRAM = 2048
"""Elements of K (and as many of V) one K/V-write program moves: ``(token, KV head)`` rows
times the padded head size (bounds registers on a GPU, launches in the interpreter)."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor, *, check_values: bool = True,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write each token's K and V at its slot of the paged cache, in place.

    Args:
        key: ``[num_tokens, num_kv_heads, head_size]``, float32/float16/bfloat16, on the
            cache's device; last dim contiguous.
        value: same shape, dtype and device as ``key``.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_size]`` (any strides with
            a contiguous last dim, e.g. ``kv_cache[:, 0]``); ``key`` is cast to its dtype.
        value_cache: same shape as ``key_cache`` (e.g. ``kv_cache[:, 1]``).
        slot_mapping: ``[num_tokens]``, ``torch.int64``, same device; units: flat slot
            ``block_id * block_size + offset``. Tokens whose slot is ``PAD_SLOT_ID`` are
            skipped (nothing is written for them).
        check_values: check the slots where they are checked (below); ``False`` when the
            caller already did.
        k_scale, v_scale: float32 ``[]`` or ``[num_kv_heads]`` or ``None`` (1.0): an fp8
            cache stores ``saturate(x / scale)`` (``core/kv_quant.py``); others ignore them.

    Raises:
        MetadataError: shapes that disagree, a slot mapping that is not int64; where values are checked (CPU tensors always,
            a GPU with ``ATTNPLUG_VALIDATE=1``: :mod:`~attnplug.backends.common.value_checks`),
            a slot outside the cache that is not ``PAD_SLOT_ID``. Nothing is written then.

    Only the addressed slots change. Does not synchronise with the host; graph-capturable.
    """
    num_tokens = slot_mapping.shape[0]
    _, block_size, num_kv_heads, head_size = key_cache.shape
    if (key.shape[0] < num_tokens or tuple(key.shape[1:]) != (num_kv_heads, head_size)
            or value.shape != key.shape or value_cache.shape != key_cache.shape
            or slot_mapping.dtype != torch.int64):
        raise MetadataError(
            f"write_kv_cache: key {tuple(key.shape)}, value {tuple(value.shape)}, key_cache "
            f"{tuple(key_cache.shape)}, value_cache {tuple(value_cache.shape)}, slot_mapping [{num_tokens}]: need "
            f"key/value [>= num_tokens, num_kv_heads, head_size] matching the caches' "
            f"[num_blocks, block_size, num_kv_heads, head_size], and an int64 slot_mapping (got "
            f"{slot_mapping.dtype})")
    if num_tokens == 0:
        return
    if check_values and values_checked(key_cache.device):
        check_slots(slot_mapping, key_cache.shape[0], block_size, "write_kv_cache")
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    padded = _next_pow2(head_size)
    rows_per_program = max(1, WRITE_ELEMENTS_PER_PROGRAM // padded)
    num_rows = num_tokens * num_kv_heads
    kernels = kernel_module("cache_kernels")
    kv_fp8 = is_quantized(key_cache.dtype)
    k_s, v_s = ((per_head_scales(k_scale, num_kv_heads, key.device), per_head_scales(v_scale, num_kv_heads, key.device))
                if kv_fp8 else (slot_mapping, slot_mapping))
    launch(kernels, "write_kv_cache_kernel", (-(-num_rows // rows_per_program),),
        key, value, key_cache, value_cache, slot_mapping, k_s, v_s, num_rows,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, HEAD_SIZE_PADDED=padded,
        ROWS_PER_PROGRAM=rows_per_program, BLOCK_SIZE=block_size,
        KV_FP8=kv_fp8, FP8_MAX=float(torch.finfo(key_cache.dtype).max) if kv_fp8 else 0.0,
        FP8_MANTISSA=3 if key_cache.dtype == torch.float8_e4m3fn else 2,
        FP8_MIN_EXP=-6 if key_cache.dtype == torch.float8_e4m3fn else -14, ROUND_ON_GRID=kv_fp8 and interpreting(),
    )


def compute_slot_mapping(query_start_loc: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                         block_size: int, slot_mapping: torch.Tensor, num_reqs: int,
                         num_tokens_padded: int | None = None) -> torch.Tensor:
    """The flat KV slot of every scheduled token of one cache group, on the device.

    ``slot = block_table[req, pos // block_size] * block_size + pos % block_size``
    (docs/architecture.md, "Conventions"), one program per request (plus one that pads). This is the GPU
    counterpart of the runner's numpy path (``BlockTable.compute_slot_mapping``), for a
    runner whose positions and block table already live on the GPU.

    Args:
        query_start_loc: ``[>= num_reqs + 1]``, ``torch.int32``, device; tokens; exclusive
            prefix sum of the per-request query lengths (``[0] == 0``).
        positions: ``[>= num_actual_tokens]``, ``torch.int64``, device; each token's
            position in its request (``num_computed_tokens + offset``).
        block_table: ``[>= num_reqs, max_num_blocks_per_req]``, ``torch.int32``, device;
            block ids in units of ``block_size`` tokens (the kernel table with the kernel
            block size, or the manager table with the manager block size: the slot is
            the same). Precondition: ``pos // block_size < max_num_blocks_per_req``.
        block_size: tokens per block of ``block_table``.
        slot_mapping: ``[>= num_tokens_padded]``, ``torch.int64``, device; the output buffer
            (a persistent buffer for CUDA graphs).
        num_reqs: real requests (rows of ``block_table`` used).
        num_tokens_padded: tokens to fill (default ``positions.shape[0]``); slots from
            ``query_start_loc[num_reqs]`` up to it get ``PAD_SLOT_ID``.

    Returns:
        ``slot_mapping[:num_tokens_padded]`` (a view of the output buffer).

    Raises:
        MetadataError: a buffer too small or a dtype other than the ones above; where
            values are checked (CPU tensors always, a GPU with ``ATTNPLUG_VALIDATE=1``), real
            tokens past ``num_tokens_padded`` or ``positions``, or a position past the block
            table. The kernel itself never writes past ``num_tokens_padded``.

    Does not synchronise with the host; graph-capturable.

    Examples:
        >>> import torch  # doctest: +SKIP
        >>> qsl = torch.tensor([0, 1, 4, 6], dtype=torch.int32, device="cuda")  # doctest: +SKIP
        >>> pos = torch.tensor([5, 0, 1, 2, 8, 9], device="cuda")  # doctest: +SKIP
        >>> bt = torch.tensor([[1, 2, 0], [5, 0, 0], [3, 7, 4]], dtype=torch.int32, device="cuda")  # doctest: +SKIP
        >>> out = torch.empty(8, dtype=torch.int64, device="cuda")  # doctest: +SKIP
        >>> compute_slot_mapping(qsl, pos, bt, 4, out, num_reqs=3, num_tokens_padded=8).tolist()  # doctest: +SKIP
        [9, 20, 21, 22, 16, 17, -1, -1]
    """
    total = positions.shape[0] if num_tokens_padded is None else int(num_tokens_padded)
    problems = []
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape[0] < num_reqs + 1:
        problems.append(f"query_start_loc must be int32 with >= num_reqs + 1 = {num_reqs + 1} entries, got "
                        f"{query_start_loc.dtype} [{query_start_loc.shape[0]}]")
    if positions.dtype != torch.int64:
        problems.append(f"positions must be int64, got {positions.dtype}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] < num_reqs:
        problems.append(f"block_table must be int32 [>= num_reqs = {num_reqs}, max_num_blocks_per_req], got "
                        f"{block_table.dtype} {tuple(block_table.shape)}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] < total:
        problems.append(f"slot_mapping must be int64 with >= {total} entries, got {slot_mapping.dtype} "
                        f"[{slot_mapping.shape[0]}]")
    if block_table.stride(-1) != 1:
        problems.append("block_table's last dim must be contiguous")
    if not problems and num_reqs and values_checked(positions.device):
        num_real = int(query_start_loc[num_reqs])
        if num_real > min(total, positions.shape[0]):
            problems.append(f"query_start_loc[num_reqs] = {num_real} real tokens, more than num_tokens_padded = "
                            f"{total} or positions [{positions.shape[0]}]")
        else:
            blocks = positions[:num_real] // block_size
            if bool(((blocks < 0) | (blocks >= block_table.shape[1])).any()):
                problems.append(f"a position outside [0, {block_table.shape[1] * block_size}): the block table has "
                                f"{block_table.shape[1]} blocks of {block_size} per request")
    if problems:
        raise MetadataError("compute_slot_mapping: " + "; ".join(problems) + ". Pass the runner's device buffers.")
    kernels = kernel_module("cache_kernels")
    launch(kernels, "slot_mapping_kernel", (num_reqs + 1,),
        query_start_loc, positions, block_table, slot_mapping, num_reqs, total, block_table.stride(0),
        BLOCK_SIZE=int(block_size), PAD_SLOT=PAD_SLOT_ID, TOKENS_PER_ITER=256,
    )
    return slot_mapping[:total]


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
