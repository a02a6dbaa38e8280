"""Finding FlashMLA's sparse kernel (``flash_mla.flash_mla_sparse_fwd``), lazily; never raises."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable


def load_flash_mla_sparse() -> tuple[Callable | None, str]:
    """``(flash_mla.flash_mla_sparse_fwd, "")`` or ``(None, why)``; never raises."""
    if importlib.util.find_spec("flash_mla") is None:
        return None, ("the flash_mla package is not installed (build FlashMLA from "
                      "https://github.com/deepseek-ai/FlashMLA on a Hopper or Blackwell GPU)")
    try:
        module = importlib.import_module("flash_mla")
    except Exception as exc:  # a broken install must not break the registry
        return None, f"flash_mla failed to import: {type(exc).__name__}: {exc}"
    fn = getattr(module, "flash_mla_sparse_fwd", None)
    return (fn, "") if fn is not None else (None, "flash_mla lacks flash_mla_sparse_fwd (a release before V3.2)")
