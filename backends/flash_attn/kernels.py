"""Finding the installed FlashAttention kernels, lazily, and why they may be missing.

Two packages provide them (docs/backends.md):

* **FlashAttention 3** (``hopper/`` of flash-attention, module ``flash_attn_interface``):
  ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, page_table=,
  cu_seqlens_q=, max_seqlen_q=, ...)`` with any page size, and
  ``get_scheduler_metadata(...)``.
* **FlashAttention 2** (package ``flash_attn`` >= 2.6): ``flash_attn_varlen_func(q, k, v,
  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ..., block_table=)``; paged
  K/V needs a page size that is a multiple of 256.

FA3 wins when both are installed. Nothing here imports either package at module import
time; :func:`installed_kernels` imports once and caches the outcome. Never raises.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from attnplug.backends.common.versions import version_tuple

FA2_MIN_VERSION: tuple[int, int] = (2, 6)
"""First flash-attn 2 release whose ``flash_attn_varlen_func`` takes ``block_table`` and
``softcap``."""

FA2_PAGE_SIZE_MULTIPLE: int = 256
"""Upstream FA2 paged K/V: ``page_block_size % 256 == 0``."""

FA2_KERNEL_BLOCK_SIZES: tuple[int, ...] = (256, 512, 1024, 2048)
"""Kernel block sizes declared under FA2 (the multiples of 256 a manager block is likely to
be split into)."""

INSTALL_HINT = ("pip install flash-attn --no-build-isolation, the attnplug extra 'flash-attn' "
                "(builds against the installed CUDA torch)")


@dataclass(frozen=True)
class FlashAttnKernels:
    """The entry points of one FlashAttention installation (or of an emulator).

    Attributes:
        version: 2 or 3: which calling convention ``FlashAttnImpl`` uses.
        source: where they come from, for messages (``"flash_attn 2.7.4"``...).
        varlen_func: FA2 ``flash_attn_varlen_func`` (``None`` under FA3).
        with_kvcache: FA3 ``flash_attn_with_kvcache`` (``None`` under FA2).
        get_scheduler_metadata: FA3 ``get_scheduler_metadata`` or ``None``.
        emulated: True for the CPU emulators (``attnplug.backends.emulators``).
    """

    version: int
    source: str
    varlen_func: Callable | None = None
    with_kvcache: Callable | None = None
    get_scheduler_metadata: Callable | None = None
    emulated: bool = False


FA3_KVCACHE_PARAMETERS = ("page_table", "cu_seqlens_q", "max_seqlen_q", "softcap", "scheduler_metadata",
                          "return_softmax_lse")
"""Keywords of FA3's ``flash_attn_with_kvcache`` the impl passes (older FA3 builds lack some)."""


def _missing_parameters(fn: Callable, names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` ``fn`` does not take (none when its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [n for n in names if n not in params]


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[FlashAttnKernels | None, str]:
    problems = []
    if importlib.util.find_spec("flash_attn_interface") is not None:
        try:
            fa3 = importlib.import_module("flash_attn_interface")
            missing = _missing_parameters(fa3.flash_attn_with_kvcache, FA3_KVCACHE_PARAMETERS)
            if missing:
                problems.append(f"flash_attn_interface (FA3) is too old: flash_attn_with_kvcache lacks "
                                f"{', '.join(missing)}, which varlen paged attention needs ({INSTALL_HINT})")
            else:
                return FlashAttnKernels(3, "flash_attn_interface (FlashAttention 3)",
                                        with_kvcache=fa3.flash_attn_with_kvcache,
                                        get_scheduler_metadata=getattr(fa3, "get_scheduler_metadata", None)), ""
        except Exception as exc:  # a broken build must not break the registry
            problems.append(f"flash_attn_interface (FA3) failed to import: {type(exc).__name__}: {exc}")
    if importlib.util.find_spec("flash_attn") is not None:
        try:
            fa2 = importlib.import_module("flash_attn")
            version = str(getattr(fa2, "__version__", "0"))
            if version_tuple(version) < FA2_MIN_VERSION:
                problems.append(f"flash_attn {version} is too old: paged varlen attention with soft-cap needs "
                                f">= {'.'.join(map(str, FA2_MIN_VERSION))}; upgrade ({INSTALL_HINT})")
            else:
                return FlashAttnKernels(2, f"flash_attn {version}", varlen_func=fa2.flash_attn_varlen_func), ""
        except Exception as exc:
            problems.append(f"flash_attn failed to import: {type(exc).__name__}: {exc}")
    if not problems:
        problems.append(f"the flash-attn package is not installed ({INSTALL_HINT})")
    return None, "; ".join(problems)


def installed_kernels() -> FlashAttnKernels | None:
    """The installed kernels (FA3 preferred), or ``None``. Imports at most once."""
    return _probe()[0]


def installed_version() -> int | None:
    """2 or 3 when flash-attn imports, else ``None``."""
    kernels = installed_kernels()
    return None if kernels is None else kernels.version


def unavailable_reason() -> str | None:
    """Why the real backend cannot run here (missing package, no CUDA), or ``None``."""
    kernels, why = _probe()
    reasons = [] if kernels is not None else [why]
    if not torch.cuda.is_available():
        reasons.append("no CUDA device (torch.cuda.is_available() is False): the kernels run on NVIDIA GPUs only")
    return "; ".join(reasons) or None


def kernel_block_sizes_for(version: int | None) -> tuple[int, ...] | None:
    """Declared kernel block sizes: any (``None``) under FA3, multiples of 256 under FA2 (and
    when nothing is installed: FA2 is the default)."""
    return None if version == 3 else FA2_KERNEL_BLOCK_SIZES


def _live_params():
    from attnplug.backends.common.layer_params import LiveLayerParams
    return LiveLayerParams()


LIVE_LAYER_PARAMS = _live_params()
"""The parameters of every live ``FlashAttnImpl`` (weakly held): the builder reads the
query-head count, window and soft-cap flag of its group's layers for FA3's
``get_scheduler_metadata`` (see ``attnplug.backends.common.layer_params``)."""
