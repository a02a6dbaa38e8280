"""``FlashInferBackend``: paged attention with FlashInfer's decode and prefill wrappers."""

from __future__ import annotations

import torch

from attnplug.backends.common.features import WindowAndSoftCapFeatures
from attnplug.backends.flashinfer.kernels import unavailable_reason
from attnplug.core.contracts import AttentionBackend, AttentionImpl, AttentionLayerConfig, AttentionMetadataBuilder

HEAD_SIZES: tuple[int, ...] = (64, 128, 256)
"""Head sizes FlashInfer's kernels are built for (its ahead-of-time kernel package, or its JIT at first use)."""


class FlashInferBackend(WindowAndSoftCapFeatures, AttentionBackend):
    """FlashInfer over attnplug's paged KV cache: decodes first (one decode wrapper),
    prefills last (one prefill wrapper), each planned once per step.

    Capabilities: float16/bfloat16, head sizes 64/128/256, any kernel block (page) size,
    GQA/MQA, sliding window (``window_left = W - 1``), logits soft-cap, decoder (causal)
    attention, attention sinks (``run(sinks=)``), fp8 KV caches (e4m3 / e5m2; per-tensor
    scales as ``run(k_scale=, v_scale=)``, per-KV-head ones folded into query and output);
    CUDA only. CUDA graphs: ``UNIFORM_SINGLE_TOKEN_DECODE`` (pure-decode
    batches run on CUDA-graph decode wrappers with fixed buffers; ``plan()`` itself runs
    outside graphs, in the builder).

    KV cache per layer: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``, exactly
    FlashInfer's ``NHD`` paged layout ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
    (the attnplug default), passed to ``run()`` as is.

    Examples:
        >>> FlashInferBackend.get_name()
        'flashinfer'
        >>> FlashInferBackend.get_kv_cache_shape(num_blocks=8, block_size=16, num_kv_heads=2, head_size=64)
        (8, 2, 16, 2, 64)
    """

    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_head_sizes = HEAD_SIZES
    supported_kernel_block_sizes = None
    supported_devices = ("cuda",)
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")
    """fp8 caches: planned with ``kv_data_type`` = the cache dtype, read with ``run(k_scale=,
    v_scale=)`` (``impl.py``)."""
    supports_per_head_kv_scales = True
    """FlashInfer's ``k_scale`` / ``v_scale`` are per-tensor floats; per-KV-head scales are folded
    exactly into the query (``k_scale``) and the output (``v_scale``) by the impl."""

    @classmethod
    def get_name(cls) -> str:
        return "flashinfer"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.flashinfer.builder import FlashInferMetadataBuilder
        return FlashInferMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        from attnplug.backends.flashinfer.impl import FlashInferImpl
        return FlashInferImpl

    @classmethod
    def supports_sink(cls) -> bool:
        """``run(..., sinks=)`` (flashinfer-python 0.6.18, both wrappers)."""
        return True

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Available when ``flashinfer`` imports and CUDA is present."""
        why = unavailable_reason()
        return why is None, why or ""

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig) -> list[str]:
        """The base checks (fp8 caches: ``supported_kv_cache_dtypes``) plus: an unquantized KV
        cache must be in the activation dtype."""
        from attnplug.core.kv_quant import is_quantized

        reasons = super().validate_configuration(layer)
        kv = layer.effective_kv_cache_dtype
        if not is_quantized(kv) and kv != layer.dtype:
            reasons.append(f"kv_cache_dtype {kv} differs from dtype {layer.dtype}: an unquantized cache must be in "
                           "the queries' dtype (quantized caches: fp8_e4m3 / fp8_e5m2)")
        return reasons
