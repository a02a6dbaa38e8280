"""``TorchNativeMLABackend``: MLA in plain torch, any shape, CPU and CUDA (the reference)."""

from __future__ import annotations

import torch

from attnplug.core.contracts import AttentionMetadataBuilder
from attnplug.core.mla import MLABackend, MLAImpl


class TorchNativeMLABackend(MLABackend):
    """Reference MLA: straightforward math for both phases, readable over fast.

    Capabilities: float32/float16/bfloat16, any ``kv_lora_rank`` / ``qk_rope_head_dim``,
    any kernel block size, CPU and CUDA. Cache: ``[num_blocks, block_size, kv_lora_rank +
    qk_rope_head_dim]``.

    Examples:
        >>> TorchNativeMLABackend.get_name(), TorchNativeMLABackend.kv_cache_kind
        ('torch_native_mla', 'mla')
        >>> TorchNativeMLABackend.get_kv_cache_shape(num_blocks=8, block_size=16, num_kv_heads=1, head_size=576)
        (8, 16, 576)
    """

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kernel_block_sizes = None
    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_name(cls) -> str:
        return "torch_native_mla"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.mla.common.builder import MLACommonMetadataBuilder
        return MLACommonMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[MLAImpl]:
        from attnplug.backends.mla.torch_native.impl import TorchNativeMLAImpl
        return TorchNativeMLAImpl
