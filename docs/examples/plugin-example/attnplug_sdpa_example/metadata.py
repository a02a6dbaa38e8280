"""``SdpaMetadata`` and its builder: where each request's queries and keys are.

The builder runs once per step per cache group. It turns the runner's
``CommonAttentionMetadata`` into flat key slots (every request's keys ``0 ..
seq_len - 1``, request after request) and host-side per-request offsets, so that
``forward`` (once per layer) does no host synchronisation.
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
    key_slots: torch.Tensor
    """``[sum(seq_lens)]`` int64, device: flat cache slot of every key of every request."""
    write_token_indices: torch.Tensor
    """``[num_writes]`` int64, device: rows of ``key``/``value`` to write (real slots only)."""
    write_slots: torch.Tensor
    """``[num_writes]`` int64, device: the slot of each of those rows."""


def _key_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots of keys ``0 .. seq_len-1`` of every request (vectorized over keys)."""
    device = block_table.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(seq_lens.shape[0], device=device), seq_lens)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    pos = torch.arange(req.shape[0], device=device) - starts[req]
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
        key_start = torch.zeros(n + 1, dtype=torch.int64)
        key_start[1:] = torch.cumsum(seq_lens, 0)
        rows, slots = _writes(cm.slot_mapping, cm.num_actual_tokens)
        return SdpaMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=tuple(cm.query_start_loc_cpu[: n + 1].tolist()),
            key_start_loc=tuple(key_start.tolist()),
            seq_lens=tuple(seq_lens.tolist()),
            key_slots=_key_slots(cm.block_table_tensor[:n], seq_lens, self.kv_cache_spec.block_size),
            write_token_indices=rows,
            write_slots=slots,
        )

    def update_block_table(self, metadata: SdpaMetadata, block_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> SdpaMetadata:
        """The same step's metadata for another cache group with the same spec."""
        n = len(metadata.seq_lens)
        seq_lens = torch.tensor(metadata.seq_lens, dtype=torch.int64)
        rows, slots = _writes(slot_mapping, metadata.num_actual_tokens)
        return dataclasses.replace(
            metadata, key_slots=_key_slots(block_table[:n], seq_lens, self.kv_cache_spec.block_size),
            write_token_indices=rows, write_slots=slots)
