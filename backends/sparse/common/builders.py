"""The two sparse builders: one lowers the common metadata for an ``indexer`` group
(:class:`~attnplug.core.sparse.SelectorMetadata`), the other for a sparse ``mla`` group
(:class:`~attnplug.core.sparse.SparseMLAMetadata`). Both carry the per-token key ranges
(:func:`~attnplug.backends.sparse.common.ranges.token_ranges`): prefill chunks and decodes are
one case (a query's causal range), so neither builder needs the batch reordered. Every
build returns a fresh object; no per-step state is kept.
"""

from __future__ import annotations

from attnplug.backends.sparse.common.ranges import token_ranges
from attnplug.core.contracts import AttentionCGSupport, AttentionMetadataBuilder
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.sparse import SelectorMetadata, SparseMLAMetadata


class SelectorMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`SelectorMetadata` for an ``indexer`` cache group."""

    cudagraph_support = AttentionCGSupport.NEVER

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SelectorMetadata:
        """The step's :class:`SelectorMetadata` (``common_prefix_len`` ignored: no cascade)."""
        cm = common_attn_metadata
        n = cm.num_reqs
        return SelectorMetadata(num_reqs=n, num_actual_tokens=cm.num_actual_tokens,
                                block_size=self.kv_cache_spec.block_size, slot_mapping=cm.slot_mapping,
                                block_table=cm.block_table_tensor[:n], seq_lens=cm.seq_lens[:n],
                                ranges=token_ranges(cm))


class SparseMLAMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`SparseMLAMetadata` for an ``mla`` group of sparse layers."""

    cudagraph_support = AttentionCGSupport.NEVER

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SparseMLAMetadata:
        """The step's :class:`SparseMLAMetadata` (``common_prefix_len`` ignored)."""
        cm = common_attn_metadata
        n = cm.num_reqs
        return SparseMLAMetadata(num_reqs=n, num_actual_tokens=cm.num_actual_tokens,
                                 block_size=self.kv_cache_spec.block_size, slot_mapping=cm.slot_mapping,
                                 block_table=cm.block_table_tensor[:n], ranges=token_ranges(cm))
