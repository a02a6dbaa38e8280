"""``IndexerSpec``: the cache of a sparse-attention indexer (DeepSeek-V3.2's lightning indexer).

A DeepSeek-V3.2 layer keeps two caches: the MLA latent row (:class:`MLAAttentionSpec`) and,
beside it, the indexer's key of every token, one ``index_head_dim`` row that the selector
scores each query against to pick the tokens the sparse MLA attends to (docs/mla.md, "The
sparse path"). The two differ in width (and, in production, in format), so the indexer
keys are their own cache group: a sibling spec, with its own block size and dtype, block
tables, slot mapping, prefix caching and preemption handled like a full-attention group's
(``GroupKind.INDEXER`` is one of ``PAGED_FULL_KINDS``). Names follow vLLM's
``IndexerSpec`` / ``DeepseekV32IndexerBackend`` (``vllm/v1/kv_cache_interface.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnplug.cache_groups.kinds import GroupKind
from attnplug.cache_groups.specs import FullAttentionSpec, _dtype_bytes
from attnplug.core.errors import KVCacheSpecError


@dataclass(frozen=True)
class IndexerSpec(FullAttentionSpec):
    """One indexer key row of ``index_head_dim`` values per token and layer.

    ``head_size`` (= ``index_head_dim``) and ``num_kv_heads`` (1) are derived; passing other
    values raises. A block holds ``block_size`` rows (no K/V halves): a page is
    ``block_size * index_head_dim * dtype size`` bytes. The fp8 format of production
    checkpoints (a scale per row) is not modelled yet: ``dtype`` is the row's float dtype.

    Raises:
        KVCacheSpecError: ``index_head_dim`` not a positive int, or ``head_size`` /
            ``num_kv_heads`` other than the derived values.

    Examples:
        >>> import torch
        >>> s = IndexerSpec(block_size=64, index_head_dim=128, dtype=torch.bfloat16)
        >>> s.kind.value, s.head_size, s.page_size_bytes, s.bytes_per_token
        ('indexer', 128, 16384, 256)
    """

    num_kv_heads: int = 1
    head_size: int = 0
    index_head_dim: int = 128

    def __post_init__(self):
        d = self.index_head_dim
        if not isinstance(d, int) or isinstance(d, bool) or d <= 0:
            raise KVCacheSpecError(f"index_head_dim must be a positive int, got {d!r}")
        if self.head_size not in (0, d):
            raise KVCacheSpecError(f"head_size {self.head_size} != index_head_dim {d} (leave head_size out: "
                                   "it is derived)")
        if self.num_kv_heads != 1:
            raise KVCacheSpecError(f"num_kv_heads must be 1 for an indexer cache (one key row per token), "
                                   f"got {self.num_kv_heads!r}")
        object.__setattr__(self, "head_size", d)
        super().__post_init__()

    @property
    def kind(self) -> GroupKind:
        return GroupKind.INDEXER

    @property
    def bytes_per_token(self) -> int:
        """``index_head_dim * dtype size``: one layer's key row."""
        return self.index_head_dim * _dtype_bytes(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """``block_size * index_head_dim * dtype size``: one row per token."""
        return self.block_size * self.bytes_per_token


__all__ = ["IndexerSpec"]
