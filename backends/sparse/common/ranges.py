"""Per-token key ranges, request-relative positions -> cache slots, and the key-row write.

All plain torch on the compute device, no host synchronisation (graph-safe shapes).
"""

from __future__ import annotations

import torch

from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.sparse import TokenRanges


def token_ranges(cm: CommonAttentionMetadata) -> TokenRanges:
    """Each query token's request and causal key range, from the common metadata.

    Token ``t`` of request ``r`` (``query_start_loc[r] <= t < query_start_loc[r + 1]``) is at
    position ``seq_lens[r] - (query_start_loc[r + 1] - t)`` and sees positions ``0 ..
    position`` (e.g. ``query_start_loc [0, 1, 4]``, ``seq_lens [7, 5]``: positions ``[6, 2,
    3, 4]``, ``key_end [7, 3, 4, 5]``). Tokens ``>= num_actual_tokens`` (padding up to
    ``slot_mapping``'s length) get request 0 and an empty range.
    """
    n, t_real = cm.num_reqs, cm.num_actual_tokens
    num_tokens = cm.slot_mapping.shape[0]
    dev = cm.query_start_loc.device
    t = torch.arange(num_tokens, device=dev, dtype=torch.int64)
    qsl = cm.query_start_loc[: n + 1].to(torch.int64)
    real = t < t_real
    req = torch.where(real, torch.searchsorted(qsl[1:].contiguous(), t, right=True), torch.zeros_like(t))
    req = req.clamp_(max=max(n - 1, 0))
    seq = cm.seq_lens[:n].to(torch.int64)
    if n:
        pos = seq[req] - (qsl[req + 1] - t)
    else:
        pos = torch.zeros_like(t)
    key_end = torch.where(real, pos + 1, torch.zeros_like(pos)).to(torch.int32)
    return TokenRanges(req_of_token=req, key_start=torch.zeros_like(key_end), key_end=key_end,
                       max_key_len=int(cm.max_seq_len))


def positions_to_slots(indices: torch.Tensor, req_of_token: torch.Tensor, block_table: torch.Tensor,
                       block_size: int) -> torch.Tensor:
    """Request-relative positions -> flat cache rows (``block_id * block_size + offset``).

    Args:
        indices: ``[T, K]`` int (``-1`` = none).
        req_of_token: ``[T]`` int64, each row's request.
        block_table: ``[num_reqs, max_blocks]`` int32, kernel block ids.
        block_size: kernel block size.

    Returns:
        ``[T, K]`` ``torch.int64``; ``-1`` where ``indices`` is ``-1``.
    """
    valid = indices >= 0
    p = torch.where(valid, indices, torch.zeros_like(indices)).to(torch.int64)
    blocks = block_table.to(torch.int64)[req_of_token[: indices.shape[0]].unsqueeze(1), p // block_size]
    return torch.where(valid, blocks * block_size + p % block_size, torch.full_like(p, -1))


def write_rows(rows: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``rows[t]`` at ``slot_mapping[t]`` of a one-row-per-token cache, in place.

    Args:
        rows: ``[>= num_tokens, D]``; cast to the cache dtype.
        kv_cache: ``[num_blocks, block_size, D]``.
        slot_mapping: ``[num_tokens]``, ``torch.int64``; ``PAD_SLOT_ID`` = nothing written
            (redirected to the null block, which gets back what it holds).

    Raises:
        MetadataError: shapes or dtypes that disagree (nothing is written).
    """
    n = slot_mapping.shape[0]
    if (kv_cache.dim() != 3 or slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64 or rows.dim() != 2
            or rows.shape[0] < n or rows.shape[1] != kv_cache.shape[2]):
        raise MetadataError(f"write_rows: rows {tuple(rows.shape)}, kv_cache {tuple(kv_cache.shape)}, slot_mapping "
                            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}: need int64 slot_mapping [num_tokens] "
                            "and rows [>= num_tokens, kv_cache.shape[2]]")
    if n == 0:
        return
    flat = kv_cache.view(-1, kv_cache.shape[2])
    real = slot_mapping != PAD_SLOT_ID
    slots = torch.where(real, slot_mapping, torch.full_like(slot_mapping, NULL_BLOCK_ID * kv_cache.shape[1]))
    flat.index_put_((slots,), torch.where(real.unsqueeze(1), rows[:n].to(kv_cache.dtype), flat[slots]))
