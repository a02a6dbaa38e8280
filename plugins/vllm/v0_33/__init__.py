"""The bridge's adapter for vLLM 0.33 (the CUDA wheel; on CPU tested at the interface level).

Where vLLM 0.33 keeps every name the bridge uses (``_vllm`` re-exports them), and
:data:`INTERFACE`, the shape of the vLLM interface this adapter was written against.

What 0.33 changed for backends (from 0.32; ``v0_32/interface.py`` vs ``interface.py``): KV-cache
planning moved to ``vllm.v1.core.kv_cache_planning`` and ``get_kv_cache_configs`` takes the
model's global KV-cache groups (:func:`plan_kv_cache`); KV specs carry ``is_draft`` (a draft
model's layers; excluded from equality, so grouping is unchanged and the bridge ignores it);
backends gained ``supports_kv_cache_update_bypass`` (default ``False``: ``forward`` still gets
key and value) and impls ``set_interleaved_v_cache`` (default: no-op, the bridge's layout
is unaffected). ``CommonAttentionMetadata``, the impl and builder signatures and
``KVCacheLayout`` are unchanged.
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
from vllm.v1.core.kv_cache_planning import (  # moved from kv_cache_utils in 0.33
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import SlidingWindowSpec as VllmSlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from attnplug.plugins.vllm.v0_33.interface import INTERFACE
from attnplug.plugins.vllm.versions import ADAPTER_NAMES

MINOR = (0, 33)


def plan_kv_cache(vllm_config: VllmConfig, kv_cache_spec: dict, available_memory: int,
                  supported_layouts: list[str]) -> tuple:
    """One worker's ``KVCacheConfig`` and the negotiated ``KVCacheLayout``, as 0.33's engine
    core plans them (``EngineCore._initialize_kv_caches``): the layout resolved first, then
    the model's global KV-cache groups (new in 0.33), then ``get_kv_cache_configs`` with them."""
    layout = resolve_kv_cache_layout(vllm_config, [supported_layouts], list(kv_cache_spec.values()))
    groups = get_global_kv_cache_groups(vllm_config, [kv_cache_spec])
    vllm_config.adjust_dcp_kv_cache_interleave_size(groups)
    (config,) = get_kv_cache_configs(vllm_config, [kv_cache_spec], [available_memory], groups)
    config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return config, layout


__all__ = list(ADAPTER_NAMES)
