"""The one door to vLLM: import it, check its version, pick the adapter of its minor.

The rest of ``attnplug.plugins.vllm`` reads every vLLM name as ``_vllm.NAME``; each name
comes from the adapter package of the installed minor (``v0_32/``, ``v0_33/``: where that
minor keeps it). Importing this module imports vLLM (seconds).

Raises (at import):
    UnsupportedVllmVersion: the installed vLLM is not a release of a supported minor
        (``versions.SUPPORTED_MINORS``); one line naming the supported minors.
    AttributeError: the adapter lacks a name below (a bug in that adapter).
"""

from __future__ import annotations

import importlib

from attnplug.plugins.vllm.versions import SUPPORTED_MINORS, UnsupportedVllmVersion, adapter_name

import vllm  # noqa: E402  (after the version helpers: they are testable without vLLM)

VLLM_VERSION: str = vllm.__version__
ADAPTER = importlib.import_module(f"attnplug.plugins.vllm.{adapter_name(VLLM_VERSION)}")
"""The adapter package of the installed minor."""

Attention = ADAPTER.Attention
AttentionBackendEnum = ADAPTER.AttentionBackendEnum
KVCacheLayout = ADAPTER.KVCacheLayout
ModelConfig = ADAPTER.ModelConfig
MultipleOf = ADAPTER.MultipleOf
VllmAttentionBackend = ADAPTER.VllmAttentionBackend
VllmAttentionImpl = ADAPTER.VllmAttentionImpl
VllmAttentionType = ADAPTER.VllmAttentionType
VllmCGSupport = ADAPTER.VllmCGSupport
VllmCommonAttentionMetadata = ADAPTER.VllmCommonAttentionMetadata
VllmConfig = ADAPTER.VllmConfig
VllmMLAImpl = ADAPTER.VllmMLAImpl
VllmMetadataBuilder = ADAPTER.VllmMetadataBuilder
VllmSlidingWindowSpec = ADAPTER.VllmSlidingWindowSpec
cpu_attn_isa = ADAPTER.cpu_attn_isa
current_platform = ADAPTER.current_platform
get_current_vllm_config = ADAPTER.get_current_vllm_config
get_kv_cache_configs = ADAPTER.get_kv_cache_configs
plan_kv_cache = ADAPTER.plan_kv_cache
register_backend = ADAPTER.register_backend
set_current_vllm_config = ADAPTER.set_current_vllm_config

__all__ = ["ADAPTER", "SUPPORTED_MINORS", "UnsupportedVllmVersion", "VLLM_VERSION", "Attention",
    "AttentionBackendEnum", "KVCacheLayout", "ModelConfig", "MultipleOf", "VllmAttentionBackend",
    "VllmAttentionImpl", "VllmAttentionType", "VllmCGSupport", "VllmCommonAttentionMetadata", "VllmConfig",
    "VllmMLAImpl",
    "VllmMetadataBuilder", "VllmSlidingWindowSpec", "cpu_attn_isa", "current_platform",
    "get_current_vllm_config", "get_kv_cache_configs", "plan_kv_cache", "register_backend",
    "set_current_vllm_config"]
