"""``TorchNativeBackend``: the pure-torch golden reference backend (CPU and CUDA)."""

from __future__ import annotations

import torch

from attnplug.backends.common.features import SinksAndAlibiFeatures, WindowAndSoftCapFeatures
from attnplug.core.contracts import AttentionBackend, AttentionImpl, AttentionMetadataBuilder


class TorchNativeBackend(WindowAndSoftCapFeatures, SinksAndAlibiFeatures, AttentionBackend):
    """Reference attention in plain torch: every feature, any shape, readable over fast.

    Capabilities: float32/float16/bfloat16, any head size, any kernel block size, CPU
    and CUDA, GQA/MQA, sliding window, logits soft-cap, decoder (causal) attention.

    KV cache per layer: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``, K at
    index 0 and V at index 1 of dim 1, tokens NHD inside a block; in the model's dtype or
    fp8 (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``: written ``saturate(x / scale)``, read back
    ``stored * scale`` in float32, per-tensor or per-KV-head scales, ``core/kv_quant.py``).

    Examples:
        >>> TorchNativeBackend.get_name()
        'torch_native'
        >>> TorchNativeBackend.get_kv_cache_shape(num_blocks=8, block_size=16, num_kv_heads=2, head_size=64)
        (8, 2, 16, 2, 64)
    """

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_head_sizes = None
    supported_kernel_block_sizes = None
    supported_devices = ("cpu", "cuda")
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")
    supports_per_head_kv_scales = True

    @classmethod
    def get_name(cls) -> str:
        return "torch_native"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.torch_native.builder import TorchNativeMetadataBuilder
        return TorchNativeMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        from attnplug.backends.torch_native.impl import TorchNativeAttentionImpl
        return TorchNativeAttentionImpl


    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Always available on CPU; CUDA use additionally needs a CUDA build of torch
        (checked per layer by ``validate_configuration``)."""
        return True, ""

