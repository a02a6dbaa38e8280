"""Checks of the *values* the Triton kernels index memory with: slots, block ids, lengths.

The kernels trust ``slot_mapping``, ``block_table``, ``query_start_loc`` and ``seq_lens``:
a slot or block id past the cache is an out-of-bounds store or load (silent corruption, or
an illegal memory access on a GPU), a ``seq_len`` shorter than its query or a block table
narrower than a request's blocks a wrong answer. Reading those values means reading
device memory, which on a GPU synchronises with the host, so — like the kernels of vLLM,
FlashAttention and FlashInfer, which never check them — the compiled path does not pay
for it on every call. The checks run:

* always for CPU tensors (the interpreter; nothing to synchronise with), and
* on a GPU when ``ATTNPLUG_VALIDATE=1`` is set (the test suite sets it), except while a
  CUDA graph is being captured (a host read is illegal there) and while
  ``torch.cuda.set_sync_debug_mode`` is on (the conformance suite runs ``forward`` under
  ``"error"`` to prove it does not synchronise: that proof takes precedence).

Each raises :class:`~attnplug.core.errors.MetadataError` before any kernel runs, so a
failed call changes nothing.
"""

from __future__ import annotations

import torch

from attnplug.core import switches
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.errors import MetadataError


def values_checked(device: torch.device) -> bool:
    """Whether calls on ``device`` check index values (see the module docstring)."""
    if device.type == "cpu":
        return True
    if not switches.flag("ATTNPLUG_VALIDATE"):
        return False
    if device.type != "cuda":
        return True
    return not torch.cuda.is_current_stream_capturing() and torch.cuda.get_sync_debug_mode() == 0


def check_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int, where: str) -> None:
    """Every slot is ``PAD_SLOT_ID`` or inside the cache: ``0 <= slot < num_blocks * block_size``.

    Raises:
        MetadataError: naming the first offending token and its slot.
    """
    if slot_mapping.numel() == 0:
        return
    num_slots = num_blocks * block_size
    bad = ((slot_mapping < 0) & (slot_mapping != PAD_SLOT_ID)) | (slot_mapping >= num_slots)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise MetadataError(
            f"{where}: slot_mapping[{i}] = {int(slot_mapping[i])} is outside the cache's {num_slots} slots "
            f"({num_blocks} blocks x {block_size}) and is not PAD_SLOT_ID ({PAD_SLOT_ID}); the block table "
            "must only hold ids of blocks of this cache")


def check_page_ids(page_ids: torch.Tensor, num_blocks: int, where: str) -> None:
    """Every id of a flat page list (FlashInfer's ``paged_kv_indices``) is a block of the
    cache: ``0 <= id < num_blocks``.

    Raises:
        MetadataError: naming the first offending entry.
    """
    bad = (page_ids < 0) | (page_ids >= num_blocks)
    if page_ids.numel() and bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise MetadataError(f"{where}: page id {int(page_ids[i])} (entry {i}) is not a block of the cache "
                            f"(0 <= id < {num_blocks}); the block table must only hold ids of blocks of this cache")


def check_batch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, *,
                num_reqs: int, num_tokens: int, num_blocks: int, block_size: int, where: str) -> None:
    """The batch description the attention kernel walks is consistent with the cache.

    Checks, for the first ``num_reqs`` requests: ``query_start_loc`` starts at 0, never
    decreases and ends at most at ``num_tokens``; ``seq_lens[i] >= query_len_i``; the block
    table is at least ``cdiv(max seq_len, block_size)`` wide; every block id a request's
    keys occupy (columns ``< cdiv(seq_lens[i], block_size)``) is in ``[0, num_blocks)``.

    Raises:
        MetadataError: naming the first broken condition and the request it is in.
    """
    if num_reqs == 0:
        return
    qsl = query_start_loc[:num_reqs + 1].long()
    query_lens = qsl[1:] - qsl[:-1]
    lens = seq_lens[:num_reqs].long()
    problems = []
    if int(qsl[0]) != 0 or bool((query_lens < 0).any()) or int(qsl[-1]) > num_tokens:
        problems.append(f"query_start_loc[:{num_reqs + 1}] = {qsl.tolist()[:8]}{'...' if num_reqs > 7 else ''} must "
                        f"start at 0, never decrease and end at most at num_tokens = {num_tokens}")
    short = (lens < query_lens).nonzero()
    if short.numel():
        i = int(short[0, 0])
        problems.append(f"request {i}: seq_len {int(lens[i])} < query_len {int(query_lens[i])} (seq_lens count the "
                        "step's new tokens too)")
    needed = int(((lens.max() + block_size - 1) // block_size).clamp(min=0))
    if block_table.shape[1] < needed:
        problems.append(f"block_table is {block_table.shape[1]} blocks wide, the longest request needs {needed} "
                        f"(cdiv(max seq_len, block_size = {block_size}))")
    else:
        used = torch.arange(block_table.shape[1], device=lens.device)[None, :] < (
            (lens + block_size - 1) // block_size)[:, None]
        ids = block_table[:num_reqs].long()
        bad = used & ((ids < 0) | (ids >= num_blocks))
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            problems.append(f"request {i}: block_table[{i}, {j}] = {int(ids[i, j])} is not a block of the cache "
                            f"(0 <= id < {num_blocks})")
    if problems:
        raise MetadataError(f"{where}: " + "; ".join(problems) + ".")


__all__ = ["check_batch", "check_page_ids", "check_slots", "values_checked"]
