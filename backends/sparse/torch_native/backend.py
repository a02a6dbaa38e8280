"""The reference sparse backends: a selector (``indexer`` caches) and a consumer (``mla``)."""

from __future__ import annotations

import torch

from attnplug.core.contracts import AttentionMetadataBuilder
from attnplug.core.sparse import SelectorBackend, SelectorImpl, SparseMLABackend, SparseMLAImpl


class TorchNativeIndexerBackend(SelectorBackend):
    """Reference selector: dense scoring of every visible key, stable sort (float32).

    Capabilities: float32/float16/bfloat16 key rows, any head dim, any kernel block size,
    CPU and CUDA. Cache ``[num_blocks, block_size, index_head_dim]``.

    Examples:
        >>> TorchNativeIndexerBackend.get_name(), TorchNativeIndexerBackend.kv_cache_kind
        ('torch_native_indexer', 'indexer')
    """

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kernel_block_sizes = None
    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_name(cls) -> str:
        return "torch_native_indexer"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.sparse.common.builders import SelectorMetadataBuilder
        return SelectorMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[SelectorImpl]:
        from attnplug.backends.sparse.torch_native.selector import TorchNativeSelectorImpl
        return TorchNativeSelectorImpl


class TorchNativeSparseMLABackend(SparseMLABackend):
    """Reference consumer: gathers each query's selected latent rows, float32 softmax.

    Capabilities: float32/float16/bfloat16, any MLA dims, any kernel block size, CPU and CUDA.

    Examples:
        >>> TorchNativeSparseMLABackend.get_name(), TorchNativeSparseMLABackend.kv_cache_kind
        ('torch_native_sparse_mla', 'mla')
    """

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kernel_block_sizes = None
    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_name(cls) -> str:
        return "torch_native_sparse_mla"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.sparse.common.builders import SparseMLAMetadataBuilder
        return SparseMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[SparseMLAImpl]:
        from attnplug.backends.sparse.torch_native.consumer import TorchNativeSparseMLAImpl
        return TorchNativeSparseMLAImpl
