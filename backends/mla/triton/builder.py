"""``TritonMLAMetadataBuilder``: the common MLA builder plus the decode kernel's split count."""

from __future__ import annotations

from dataclasses import dataclass

from attnplug.backends.mla.common.builder import MLACommonMetadataBuilder
from attnplug.cache_groups.specs import cdiv
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.mla import MLADecodeMetadata

TOKENS_PER_SPLIT = 32
"""Split a decode's keys once it has more than this many per split (interpreter-friendly;
on a GPU the split count trades the reduce against idle SMs)."""
MAX_KV_SPLITS = 8


@dataclass(frozen=True)
class TritonMLADecodeMetadata(MLADecodeMetadata):
    """:class:`MLADecodeMetadata` plus ``num_kv_splits`` (a power of two, 1..8): key splits
    per decode, from the step's longest ``seq_len``."""

    num_kv_splits: int = 1


def kv_splits_for(max_seq_len: int) -> int:
    """The largest power of two <= ``cdiv(max_seq_len, TOKENS_PER_SPLIT)``, at most 8."""
    want = max(1, cdiv(max_seq_len, TOKENS_PER_SPLIT))
    return min(MAX_KV_SPLITS, 1 << (want.bit_length() - 1))


class TritonMLAMetadataBuilder(MLACommonMetadataBuilder):
    """See :class:`MLACommonMetadataBuilder`; decodes carry ``num_kv_splits``."""

    def build_decode(self, cm: CommonAttentionMetadata, num_decodes: int) -> TritonMLADecodeMetadata:
        base = super().build_decode(cm, num_decodes)
        return TritonMLADecodeMetadata(num_decodes=base.num_decodes, block_table=base.block_table,
                                       seq_lens=base.seq_lens, max_seq_len=base.max_seq_len,
                                       num_kv_splits=kv_splits_for(base.max_seq_len))
