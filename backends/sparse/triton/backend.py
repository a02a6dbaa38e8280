"""``triton_indexer`` / ``triton_sparse_mla``: the sparse contracts over Triton kernels.

Declarations depend on the Triton mode, as for ``triton_mla``: ``"cpu"`` only under
``TRITON_INTERPRET=1``, and no bfloat16 there (the interpreter's bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

from abc import ABCMeta

import torch

from attnplug.backends.triton.runtime import interpreting, unavailable_reason
from attnplug.core.contracts import AttentionMetadataBuilder
from attnplug.core.sparse import SelectorBackend, SelectorImpl, SparseMLABackend, SparseMLAImpl


class _TritonSparseMeta(ABCMeta):
    @property
    def supported_devices(cls) -> tuple[str, ...]:
        return ("cuda", "cpu") if interpreting() else ("cuda",)

    @property
    def supported_dtypes(cls) -> tuple[torch.dtype, ...]:
        if interpreting():
            return (torch.float16, torch.float32)
        return (torch.float16, torch.bfloat16, torch.float32)


def _available() -> tuple[bool, str]:
    why = unavailable_reason()
    return (why is None, why or "")


class TritonIndexerBackend(SelectorBackend, metaclass=_TritonSparseMeta):
    """Selector: ``indexer_scores_kernel`` scores every visible key (one ``tl.dot`` per tile
    of 16 positions for all heads), then a stable descending ``torch.sort`` keeps the top-k.

    Examples:
        >>> TritonIndexerBackend.get_name(), TritonIndexerBackend.kv_cache_kind
        ('triton_indexer', 'indexer')
    """

    supported_kernel_block_sizes = None

    @classmethod
    def get_name(cls) -> str:
        return "triton_indexer"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.sparse.common.builders import SelectorMetadataBuilder
        return SelectorMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[SelectorImpl]:
        from attnplug.backends.sparse.triton.impl import TritonSelectorImpl
        return TritonSelectorImpl

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return _available()


class TritonSparseMLABackend(SparseMLABackend, metaclass=_TritonSparseMeta):
    """Consumer: ``sparse_mla_kernel`` (online softmax over the selected latent rows, 16 at a
    time, ``-1`` masked).

    Examples:
        >>> TritonSparseMLABackend.get_name(), TritonSparseMLABackend.sparse
        ('triton_sparse_mla', True)
    """

    supported_kernel_block_sizes = None

    @classmethod
    def get_name(cls) -> str:
        return "triton_sparse_mla"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.sparse.common.builders import SparseMLAMetadataBuilder
        return SparseMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[SparseMLAImpl]:
        from attnplug.backends.sparse.triton.impl import TritonSparseMLAImpl
        return TritonSparseMLAImpl

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return _available()
