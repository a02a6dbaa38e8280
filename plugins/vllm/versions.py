"""Which vLLM releases the bridge serves, and which adapter serves each (no vLLM import).

vLLM changes its attention-backend interface from one minor release to the next (0.32 dropped
``get_kv_cache_shape`` for ``supported_kv_cache_layouts``; 0.33 moved KV-cache planning to
``vllm.v1.core.kv_cache_planning`` and tagged draft KV specs ``is_draft``), so the bridge has one
adapter package per supported minor (``plugins/vllm/v0_32/``, ``v0_33/``): where that minor keeps
the names the bridge uses, and what it changed. A release of any other minor is refused, not
guessed at; so are pre-releases and development builds (``0.33.0rc1``, ``0.34.0.dev12+g…``), whose
interface is not the release's.
"""

from __future__ import annotations

import re

from attnplug.core.errors import AttnplugError

SUPPORTED_MINORS: dict[tuple[int, int], str] = {(0, 32): "v0_32", (0, 33): "v0_33"}
"""``(major, minor)`` -> the adapter package (``attnplug.plugins.vllm.<name>``). How each is
tested (end to end, interface level, GPU) is in docs/vllm.md's support table."""

ADAPTER_NAMES: tuple[str, ...] = (
    "Attention", "AttentionBackendEnum", "INTERFACE", "KVCacheLayout", "MINOR", "ModelConfig", "MultipleOf",
    "VllmAttentionBackend", "VllmAttentionImpl", "VllmAttentionType", "VllmCGSupport",
    "VllmCommonAttentionMetadata", "VllmConfig", "VllmMLAImpl", "VllmMetadataBuilder", "VllmSlidingWindowSpec",
    "cpu_attn_isa", "current_platform", "get_current_vllm_config", "get_kv_cache_configs", "plan_kv_cache",
    "register_backend", "set_current_vllm_config",
)
"""The names every adapter package exports (its ``__all__``): where its minor keeps each vLLM
name the bridge reads through ``_vllm``, plus ``INTERFACE`` (the pasted fingerprint), ``MINOR``
and ``plan_kv_cache``."""

_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.\d+)*(?:\.post\d+)?(?:\+[0-9A-Za-z.]+)?$")


class UnsupportedVllmVersion(AttnplugError, RuntimeError):
    """The installed vLLM is not a release of a minor the bridge has an adapter for."""


def supported_minors() -> str:
    """``"0.32, 0.33"``: the supported minors, oldest first."""
    return ", ".join(f"{a}.{b}" for a, b in sorted(SUPPORTED_MINORS))


def adapter_name(version: str) -> str:
    """The adapter package for vLLM ``version`` (``"0.33.0"`` -> ``"v0_33"``); local tags
    (``+cpu``, ``+cu130``) and post releases are accepted.

    Raises:
        UnsupportedVllmVersion: one line naming ``version`` and the supported minors.
    """
    match = _RELEASE.match(version.strip())
    minor = (int(match.group(1)), int(match.group(2))) if match else None
    if minor not in SUPPORTED_MINORS:
        what = "a pre-release or development build" if match is None else "not a supported minor"
        raise UnsupportedVllmVersion(
            f"vLLM {version} is {what} for the attnplug bridge (supported minors: {supported_minors()}; "
            "plugins/vllm/v0_XX/requirements-cpu.txt); install one of them or unset ATTNPLUG_VLLM_BACKEND")
    return SUPPORTED_MINORS[minor]
