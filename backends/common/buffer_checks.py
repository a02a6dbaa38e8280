"""Checks of the tensors a persistent-buffer builder copies from (``build`` and
``update_block_table``), and the block-table copy itself: shared by the triton and
flash_attn builders."""

from __future__ import annotations

import torch

from attnplug.cache_groups.specs import cdiv
from attnplug.core.devices import same_device
from attnplug.core.errors import MetadataError


def check_slot_mapping(slot_mapping: torch.Tensor, num_actual_tokens: int, capacity: int,
                       device: torch.device) -> None:
    """``slot_mapping`` must be int64 ``[num_tokens]`` on ``device`` with
    ``num_actual_tokens <= num_tokens <= capacity`` (the persistent buffer's size).

    Raises:
        MetadataError: otherwise, with the values and the limit.
    """
    if (slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64
            or not same_device(slot_mapping.device, device)):
        raise MetadataError(f"slot_mapping is {slot_mapping.dtype} {tuple(slot_mapping.shape)} on "
                            f"{slot_mapping.device}; need int64 [num_tokens] on {device}.")
    if not num_actual_tokens <= slot_mapping.shape[0] <= capacity:
        raise MetadataError(
            f"slot_mapping has {slot_mapping.shape[0]} entries; need >= num_actual_tokens={num_actual_tokens} "
            f"and <= BuilderConfig.max_num_batched_tokens={capacity} (the persistent buffer's size).")


def check_block_table(block_table: torch.Tensor, num_rows: int, max_seq_len: int, *, block_size: int,
                      max_num_blocks_per_req: int, max_model_len: int, device: torch.device,
                      backend: str) -> None:
    """``block_table`` must be int32 ``[>= num_rows, max_num_blocks_per_req]`` on ``device`` and
    address ``max_seq_len`` tokens in blocks of ``block_size``.

    Raises:
        MetadataError: otherwise, naming ``backend``, the values and the limits.
    """
    if (block_table.dim() != 2 or block_table.shape[0] < num_rows or block_table.dtype != torch.int32
            or not same_device(block_table.device, device)):
        raise MetadataError(
            f"block_table_tensor is {block_table.dtype} {tuple(block_table.shape)} on {block_table.device} "
            f"but num_reqs={num_rows}: the {backend} builder needs int32 [num_reqs, max_num_blocks_per_req] on "
            f"{device}.")
    need = cdiv(max_seq_len, block_size)
    if need > min(block_table.shape[1], max_num_blocks_per_req):
        raise MetadataError(
            f"max_seq_len={max_seq_len} needs {need} blocks of {block_size} tokens per request but the "
            f"block table has {block_table.shape[1]} columns and BuilderConfig.max_model_len="
            f"{max_model_len} allows {max_num_blocks_per_req}: the keys would be "
            "unaddressable; check max_model_len and the kernel block size.")


def copy_block_table(buffer: torch.Tensor, block_table: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Copy the step's ``block_table`` rows into the persistent ``buffer`` and return
    ``buffer[:num_rows]`` at its whole width.

    The step's columns are copied (non-blocking), but the whole persistent width is returned:
    a CUDA graph captured on a narrow step must replay wider ones, and the kernels read only
    the pages ``seq_lens`` needs, so columns left from earlier steps are never read (vLLM's
    ``BlockTable`` hands out full-width rows the same way).

    Args:
        buffer: ``[max_num_reqs, max_num_blocks_per_req]`` int32, the builder's.
        block_table: ``[>= num_rows, any width]`` int32 on ``buffer``'s device (checked by
            :func:`check_block_table`).
    """
    width = min(block_table.shape[1], buffer.shape[1])
    buffer[:num_rows, :width].copy_(block_table[:num_rows, :width], non_blocking=True)
    return buffer[:num_rows]
