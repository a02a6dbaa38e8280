"""``FlashAttnBackend``: paged varlen attention with the flash-attn kernels (CUDA only).

Declarations that depend on the installed version are computed on access (class
properties through :class:`_FlashAttnBackendMeta`): ``supported_kernel_block_sizes``
is any size under FlashAttention 3 and multiples of 256 under FlashAttention 2 (or when
nothing is installed, the FA2 default), so the runner splits manager blocks into kernel
blocks the installed kernel accepts, or selection rejects the layer with the reason.
"""

from __future__ import annotations

from abc import ABCMeta

import torch

from attnplug.backends.common.features import WindowAndSoftCapFeatures
from attnplug.backends.flash_attn.kernels import (
    installed_version,
    kernel_block_sizes_for,
    unavailable_reason,
)
from attnplug.core.kv_layout import KVCacheLayout
from attnplug.core.contracts import AttentionBackend, AttentionImpl, AttentionLayerConfig, AttentionMetadataBuilder

HEAD_SIZES: tuple[int, ...] = tuple(range(8, 257, 8))
"""Head sizes: multiples of 8 up to 256 (both versions round up to their compiled sizes)."""


FA3_KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3")
"""FA3's ``flash_attn_with_kvcache`` reads ``float8_e4m3fn`` q / K / V with ``q_descale`` /
``k_descale`` / ``v_descale`` (``hopper/flash_attn_interface.py``); it has no e5m2 kernels."""

FA2_NO_FP8_REASON = ("FlashAttention 2's flash_attn_varlen_func takes no descale arguments (fp8 KV caches "
                     "need FlashAttention 3's flash_attn_with_kvcache q/k/v_descale)")


class _FlashAttnBackendMeta(ABCMeta):
    @property
    def supported_kernel_block_sizes(cls) -> tuple[int, ...] | None:
        return kernel_block_sizes_for(cls.kernels_version())

    @property
    def supported_kv_cache_dtypes(cls) -> tuple[str, ...]:
        """``auto`` and ``fp8_e4m3`` under FlashAttention 3; ``auto`` only under FA2 (and when
        nothing is installed)."""
        return FA3_KV_CACHE_DTYPES if cls.kernels_version() == 3 else ("auto",)

    @property
    def supports_per_head_kv_scales(cls) -> bool:
        """FA3's descales are ``[batch_size, num_heads_k]``: one scale per KV head."""
        return cls.kernels_version() == 3

    @property
    def supports_quant_query_input(cls) -> bool:
        """FA3 requires q in the cache's fp8 dtype: the impl quantizes it with ``layer.q_scale``."""
        return cls.kernels_version() == 3


class FlashAttnBackend(WindowAndSoftCapFeatures, AttentionBackend, metaclass=_FlashAttnBackendMeta):
    """FlashAttention (2 or 3) over attnplug's paged KV cache.

    Capabilities: float16/bfloat16, head sizes that are multiples of 8 up to 256, GQA/MQA,
    sliding window (``window_size=(W-1, 0)``), logits soft-cap, decoder (causal)
    attention, cascade attention over a shared prefix; CUDA only. fp8 KV cache
    (``fp8_e4m3``, per-tensor or per-KV-head scales) under FA3 only: the impl quantizes
    the query with ``layer.q_scale`` and passes ``q_descale`` / ``k_descale`` /
    ``v_descale`` ``[batch_size, num_kv_heads]`` float32 (FA3's fp8 output is bfloat16). Kernel block sizes:
    any under FA3, multiples of 256 under FA2. CUDA graphs: ``ALWAYS`` under FA3,
    ``UNIFORM_BATCH`` under FA2 (its kernel choice depends on host-side query lengths).

    KV cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` — K and V
    each a contiguous ``[num_blocks, block_size, num_kv_heads, head_size]`` tensor, the
    separate paged K/V the kernels take (:meth:`split_kv_cache`).

    Examples:
        >>> FlashAttnBackend.get_name()
        'flash_attn'
        >>> FlashAttnBackend.get_kv_cache_shape(num_blocks=8, block_size=256, num_kv_heads=2, head_size=64)
        (2, 8, 256, 2, 64)
    """

    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_head_sizes = HEAD_SIZES
    supported_devices = ("cuda",)
    kv_cache_layout = KVCacheLayout(dims=("kv", "block", "token", "head", "dim"))
    """``[2, num_blocks, block_size, num_kv_heads, head_size]``: ``kv_cache[0]`` / ``[1]`` are the
    contiguous ``k_cache`` / ``v_cache`` the kernels take."""

    @classmethod
    def get_name(cls) -> str:
        return "flash_attn"

    @classmethod
    def kernels_version(cls) -> int | None:
        """2 or 3 (the installed flash-attn), ``None`` when not installed."""
        return installed_version()

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.flash_attn.builder import FlashAttnMetadataBuilder
        return FlashAttnMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        from attnplug.backends.flash_attn.impl import FlashAttnImpl
        return FlashAttnImpl

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Available when flash-attn (FA3, or FA2 >= 2.6) imports and CUDA is present."""
        why = unavailable_reason()
        return why is None, why or ""

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig) -> list[str]:
        """The base checks (fp8 caches: ``supported_kv_cache_dtypes``, FA3 only, the FA2 reason
        named) plus: an unquantized KV cache must be in the activation dtype (the kernels
        read it in the query dtype)."""
        from attnplug.core.kv_quant import is_quantized

        reasons = super().validate_configuration(layer)
        kv = layer.effective_kv_cache_dtype
        if is_quantized(kv) and cls.kernels_version() != 3:
            reasons.append(FA2_NO_FP8_REASON)
        elif not is_quantized(kv) and kv != layer.dtype:
            reasons.append(f"kv_cache_dtype {kv} differs from dtype {layer.dtype}: the kernels read the cache in "
                           "the query's dtype (quantized caches: fp8_e4m3 under FlashAttention 3)")
        return reasons
