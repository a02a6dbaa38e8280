"""``SdpaMetadata`` and its builder: where each request's queries and keys are.

The builder runs once per step per cache group. It turns the runner's
``CommonAttentionMetadata`` into flat key slots (every request's keys ``first_key ..
seq_len - 1``, request after request) and host-side per-request offsets, so that
``forward`` (once per layer) does no host synchronisation.

With a sliding window of ``W`` tokens, a request's first query (position ``seq_len -
query_len``) sees nothing before ``first_key = max(0, seq_len - query_len - W + 1)``.
The blocks wholly before it have been freed: the runner replaced them by the null block
in the block table, and the block pool may have handed them to another request. So the
builder never gathers them, not even to mask them out (the conformance suite fills them
with NaN, and ``0 * NaN`` is NaN).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from attnplug import PAD_SLOT_ID, AttentionMetadataBuilder, CommonAttentionMetadata


@dataclass(frozen=True)
class SdpaMetadata:
    num_actual_tokens: int
    """Real tokens this step; rows past it are padding."""
    query_start_loc: tuple[int, ...]
    """``num_reqs + 1`` host ints: request i's queries are rows ``[q[i], q[i+1])``."""
    key_start_loc: tuple[int, ...]
    """``num_reqs + 1`` host ints: request i's keys are entries ``[k[i], k[i+1])`` of ``key_slots``."""
    seq_lens: tuple[int, ...]
    """``num_reqs`` host ints: keys per request after this step (tokens)."""
    first_key: tuple[int, ...]
    """``num_reqs`` host ints: position of request i's first gathered key (0 without a window)."""
    key_slots: torch.Tensor
    """``[sum(seq_lens - first_key)]`` int64, device: flat cache slot of keys ``first_key ..
    seq_len - 1`` of every request, request after request."""
    write_token_indices: torch.Tensor
    """``[num_writes]`` int64, device: rows of ``key``/``value`` to write (real slots only)."""
    write_slots: torch.Tensor
    """``[num_writes]`` int64, device: the slot of each of those rows."""


def _first_keys(seq_lens: torch.Tensor, query_lens: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[num_reqs]`` int64 (CPU): the first key position any query of each request sees."""
    if window is None:
        return torch.zeros_like(seq_lens)
    return (seq_lens - query_lens - window + 1).clamp(min=0)


def _key_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, first_key: torch.Tensor,
               block_size: int) -> torch.Tensor:
    """Flat slots of keys ``first_key .. seq_len-1`` of every request (vectorized over keys).

    ``seq_lens`` and ``first_key`` are ``[num_reqs]`` int64 CPU tensors; ``block_table`` is
    the ``[num_reqs, max_blocks]`` int32 device table.
    """
    device = block_table.device
    counts = (seq_lens - first_key).to(device)
    req = torch.repeat_interleave(torch.arange(counts.shape[0], device=device), counts)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(req.shape[0], device=device) - starts[req] + first_key.to(device)[req]
    return block_table[req, pos // block_size].long() * block_size + pos % block_size


def _writes(slot_mapping: torch.Tensor, num_actual_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    real = slot_mapping[:num_actual_tokens]
    rows = torch.nonzero(real != PAD_SLOT_ID).flatten()
    return rows, real[rows].long()


class SdpaMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`SdpaMetadata`. Never mutates the metadata it is given."""

    supports_update_block_table = True

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SdpaMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        seq_lens = cm.seq_lens_cpu[:n].long()
        query_start = cm.query_start_loc_cpu[: n + 1].long()
        # a SlidingWindowSpec carries the window; a FullAttentionSpec has none
        first_key = _first_keys(seq_lens, query_start.diff(), getattr(self.kv_cache_spec, "sliding_window", None))
        key_start = torch.zeros(n + 1, dtype=torch.int64)
        key_start[1:] = torch.cumsum(seq_lens - first_key, 0)
        rows, slots = _writes(cm.slot_mapping, cm.num_actual_tokens)
        return SdpaMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=tuple(query_start.tolist()),
            key_start_loc=tuple(key_start.tolist()),
            seq_lens=tuple(seq_lens.tolist()),
            first_key=tuple(first_key.tolist()),
            key_slots=_key_slots(cm.block_table_tensor[:n], seq_lens, first_key, self.kv_cache_spec.block_size),
            write_token_indices=rows,
            write_slots=slots,
        )

    def update_block_table(self, metadata: SdpaMetadata, block_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> SdpaMetadata:
        """The same step's metadata for another cache group with the same spec."""
        n = len(metadata.seq_lens)
        seq_lens = torch.tensor(metadata.seq_lens, dtype=torch.int64)
        first_key = torch.tensor(metadata.first_key, dtype=torch.int64)
        rows, slots = _writes(slot_mapping, metadata.num_actual_tokens)
        return dataclasses.replace(
            metadata, key_slots=_key_slots(block_table[:n], seq_lens, first_key, self.kv_cache_spec.block_size),
            write_token_indices=rows, write_slots=slots)
