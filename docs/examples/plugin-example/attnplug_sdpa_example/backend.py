"""``SdpaExampleBackend``: the class users select as ``sdpa_example``, and its capabilities."""

from __future__ import annotations

import torch

from attnplug import PLUGIN_API_VERSION, AttentionBackend


class SdpaExampleBackend(AttentionBackend):
    """Paged attention via ``torch.nn.functional.scaled_dot_product_attention``.

    Capabilities (what the conformance suite holds it to): float32/float16/bfloat16, any
    head size, any kernel block size, CPU and CUDA, GQA/MQA, sliding window. No logits
    soft-cap (SDPA has none), so ``validate_configuration`` rejects soft-capped layers
    and the suite skips its soft-cap cases with that reason.

    KV cache per layer: the default ``[num_blocks, 2, block_size, num_kv_heads,
    head_size]`` (K at index 0 of dim 1, V at 1), so the default ``split_kv_cache`` fits.
    """

    plugin_api_version = PLUGIN_API_VERSION
    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_head_sizes = None
    supported_kernel_block_sizes = None
    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_name(cls) -> str:
        return "sdpa_example"

    @classmethod
    def get_builder_cls(cls):
        from attnplug_sdpa_example.metadata import SdpaMetadataBuilder
        return SdpaMetadataBuilder

    @classmethod
    def get_impl_cls(cls):
        from attnplug_sdpa_example.impl import SdpaAttentionImpl
        return SdpaAttentionImpl

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        return False

    @classmethod
    def supports_mqa_gqa(cls) -> bool:
        return True

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
        return (sdpa is not None, "" if sdpa is not None else "torch has no scaled_dot_product_attention")
