"""Finding the installed FlashInfer package, lazily, and why it may be missing.

The builder needs two wrapper classes of the ``flashinfer`` module,
``BatchDecodeWithPagedKVCacheWrapper`` and ``BatchPrefillWithPagedKVCacheWrapper``
(docs/backends.md). Nothing here imports ``flashinfer`` at module import time;
:func:`installed_module` imports once and caches. ``plan()`` needs CUDA (FlashInfer
fails on CPU-only torch), so the backend is unavailable without a GPU. Never raises.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any

import torch

from attnplug.backends.common.layer_params import LiveLayerParams
from attnplug.backends.common.versions import version_tuple

INSTALL_HINT = "pip install flashinfer-python, the attnplug extra 'flashinfer' (the wheel matching your CUDA torch)"

MIN_VERSION = (0, 6, 18)
"""The oldest flashinfer-python whose wrapper signatures attnplug's calls were checked
against (0.6.18.post1 and 0.7.4 were; the ``flashinfer`` extra pins ``>=0.6.18,<0.8``)."""

LIVE_LAYER_PARAMS = LiveLayerParams()
"""The parameters of every live ``FlashInferImpl`` (weakly held): the builder plans one
decode and one prefill wrapper per distinct (query heads, ``window_left``, soft-cap,
scale) of its group's layers (see ``attnplug.backends.common.layer_params``)."""


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[Any, str]:
    if importlib.util.find_spec("flashinfer") is None:
        return None, f"the flashinfer package is not installed ({INSTALL_HINT})"
    try:
        module = importlib.import_module("flashinfer")
    except Exception as exc:  # a broken install must not break the registry
        return None, f"flashinfer failed to import: {type(exc).__name__}: {exc}"
    missing = [n for n in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper")
               if not hasattr(module, n)]
    version = str(getattr(module, "__version__", "?"))
    if missing:
        return None, f"flashinfer {version} lacks {', '.join(missing)}; upgrade ({INSTALL_HINT})"
    if version_tuple(version) < MIN_VERSION:
        return None, (f"flashinfer {version} is older than {'.'.join(map(str, MIN_VERSION))}, the oldest whose "
                      f"plan()/run() signatures attnplug was checked against; upgrade ({INSTALL_HINT})")
    return module, ""


def installed_module() -> Any | None:
    """The ``flashinfer`` module, or ``None`` when it is missing or broken."""
    return _probe()[0]


def unavailable_reason() -> str | None:
    """Why the real backend cannot run here (missing package, no CUDA), or ``None``."""
    module, why = _probe()
    reasons = [] if module is not None else [why]
    if not torch.cuda.is_available():
        reasons.append("no CUDA device (torch.cuda.is_available() is False): FlashInfer's plan() and kernels "
                       "need a CUDA GPU")
    return "; ".join(reasons) or None
