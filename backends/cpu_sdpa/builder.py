"""``CpuSdpaMetadata`` and its builder: ``torch_native``'s segments plus per-token gather indices.

``torch_native``'s segments are what the fused kernel wants: every decode in one segment
(one batched call), each multi-token request its own (no query padding). On top of them
the builder computes, once per step for all layers of the group, each segment's
**token-level gather indices** — for key column ``j`` of request ``r``, its physical block
``key_block_ids[r, j // B]`` and offset ``j % B`` — so a layer gathers its K and V in one
advanced-indexing op each, straight into the ``[H_kv, n, S, D]`` layout SDPA reads
contiguously (a whole-block ``index_select`` would give ``[n, S, H_kv, D]`` and need a
second, transposing copy).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from attnplug.backends.torch_native.builder import AttentionSegment, TorchNativeMetadata, TorchNativeMetadataBuilder
from attnplug.core.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class CpuSdpaMetadata(TorchNativeMetadata):
    """``torch_native``'s metadata (every field, same meaning) plus the gather indices."""

    key_gather: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    """One ``(block_ids, offsets)`` pair per entry of ``segments``: ``block_ids`` ``[n,
    num_key_blocks * block_size]`` ``torch.int64``, the physical block of each key column;
    ``offsets`` ``[num_key_blocks * block_size]`` ``torch.int64``, its slot in the block
    (``j % block_size``, broadcast over the requests). Empty for a cascade step."""


def segment_gather(seg: AttentionSegment, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_ids [n, S], offsets [S])`` for ``seg``'s key columns (``S = num_key_blocks *
    block_size``); see :attr:`CpuSdpaMetadata.key_gather`."""
    ids = seg.key_block_ids.long()
    offsets = torch.arange(block_size, device=ids.device).repeat(ids.shape[1])
    return ids.repeat_interleave(block_size, dim=1), offsets


class CpuSdpaMetadataBuilder(TorchNativeMetadataBuilder):
    """Builds :class:`CpuSdpaMetadata` (``torch_native``'s builder, same cascade and
    ``update_block_table`` support, plus :attr:`CpuSdpaMetadata.key_gather`)."""

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TorchNativeMetadata:
        """``torch_native``'s ``build`` (same args, errors and host synchronisation), plus the
        gather indices; a cascade step's metadata is returned as ``torch_native`` built it."""
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return md if md.cascade is not None else self._with_gather(md)

    def update_block_table(self, metadata: TorchNativeMetadata, block_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> TorchNativeMetadata:
        """``torch_native``'s ``update_block_table``, with the gather indices recomputed from
        the new block table."""
        md = super().update_block_table(metadata, block_table, slot_mapping)
        return md if md.cascade is not None else self._with_gather(md)

    def _with_gather(self, md: TorchNativeMetadata) -> CpuSdpaMetadata:
        """``md`` as a :class:`CpuSdpaMetadata` carrying each segment's gather indices."""
        fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(TorchNativeMetadata)}
        gather = tuple(segment_gather(seg, md.block_size) for seg in md.segments)
        return CpuSdpaMetadata(**fields, key_gather=gather)


__all__ = ["CpuSdpaMetadata", "CpuSdpaMetadataBuilder", "segment_gather"]
