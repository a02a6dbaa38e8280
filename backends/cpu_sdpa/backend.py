"""``CpuSdpaBackend``: paged decode and varlen prefill on torch's fused SDPA kernel (CPU)."""

from __future__ import annotations

import torch

from attnplug.backends.common.features import SinksAndAlibiFeatures, WindowAndSoftCapFeatures
from attnplug.core.contracts import AttentionBackend, AttentionImpl, AttentionMetadataBuilder


class CpuSdpaBackend(WindowAndSoftCapFeatures, SinksAndAlibiFeatures, AttentionBackend):
    """Attention on the CPU: a compiled paged kernel, else torch's fused SDPA.

    Where the optional compiled module ``_paged`` was built and takes the layer (float32 /
    bfloat16 / float16 with the cache in the same dtype, head size a multiple of 8 up to
    256; sliding window and soft-cap included), one kernel call per layer attends the query
    rows of every request ``builder.kernel_takes`` gives it (decodes and short chunks; in
    float32 prompts up to 1,024 keys too) reading K/V in place through the block table
    (``paged.py``); the other prompts run SDPA as below. Otherwise (no compiled module,
    fp8 caches, other head sizes):

    The metadata is ``torch_native``'s (:class:`~attnplug.backends.torch_native.builder.
    TorchNativeMetadataBuilder`, once per step for all layers of a group: decodes in one
    segment — split into length buckets when their lengths differ (``builder.py``) — each
    prefill its own, no query padding). Per layer and segment the impl
    gathers each request's K/V blocks once and calls the fused SDPA kernel (flash-style,
    online softmax: no ``[T, S]`` float32 logits); see ``impl.py`` for when a mask is
    still built. Logits soft-cap and cascade steps run the ``torch_native`` path for that
    layer (SDPA has no soft-cap; the cascade merge needs the LSE).

    Capabilities: float32/float16/bfloat16, any head size, any kernel block size, CPU
    only, GQA/MQA, sliding window, logits soft-cap (reference path), decoder attention,
    fp8 KV caches (e4m3 / e5m2, per-tensor or per-KV-head scales: written ``saturate(x /
    scale)``, the gathered blocks dequantised before SDPA: the SDPA path), attention sinks
    and ALiBi slopes (those layers run the ``torch_native`` reference path: neither the
    kernel nor SDPA adds them).

    KV cache per layer: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (the
    default layout; K at index 0 of dim 1).

    Examples:
        >>> CpuSdpaBackend.get_name()
        'cpu_sdpa'
    """

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_head_sizes = None
    supported_kernel_block_sizes = None
    supported_devices = ("cpu",)
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")
    supports_per_head_kv_scales = True

    @classmethod
    def get_name(cls) -> str:
        return "cpu_sdpa"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.cpu_sdpa.builder import CpuSdpaMetadataBuilder
        return CpuSdpaMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        from attnplug.backends.cpu_sdpa.impl import CpuSdpaAttentionImpl
        return CpuSdpaAttentionImpl


    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Always: the fused SDPA kernel ships with every CPU build of torch >= 2.1."""
        return True, ""


class CpuSdpaGatherBackend(CpuSdpaBackend):
    """``cpu_sdpa`` with the compiled kernel off: the SDPA path on gathered blocks for every
    layer. Not registered: ``attnplug bench attention``'s ``cpu_sdpa-gather`` rows and the
    tests of that path use it (the path a build without the compiled module runs)."""

    @classmethod
    def get_name(cls) -> str:
        return "cpu_sdpa-gather"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.cpu_sdpa.builder import CpuSdpaGatherMetadataBuilder
        return CpuSdpaGatherMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        from attnplug.backends.cpu_sdpa.impl import CpuSdpaGatherAttentionImpl
        return CpuSdpaGatherAttentionImpl
