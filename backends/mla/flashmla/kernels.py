"""Finding the installed FlashMLA package (``flash_mla``), lazily; never raises."""

from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace

INSTALL_HINT = "build FlashMLA from https://github.com/deepseek-ai/FlashMLA (a Hopper or Blackwell GPU)"


def load_flash_mla() -> tuple[SimpleNamespace | None, str]:
    """``(namespace with get_mla_metadata and flash_mla_with_kvcache, "")`` or ``(None, why)``."""
    if importlib.util.find_spec("flash_mla") is None:
        return None, f"the flash_mla package is not installed ({INSTALL_HINT})"
    try:
        module = importlib.import_module("flash_mla")
    except Exception as exc:  # a broken install must not break the registry
        return None, f"flash_mla failed to import: {type(exc).__name__}: {exc}"
    missing = [n for n in ("get_mla_metadata", "flash_mla_with_kvcache") if not hasattr(module, n)]
    if missing:
        return None, f"flash_mla lacks {', '.join(missing)}"
    return SimpleNamespace(get_mla_metadata=module.get_mla_metadata,
                           flash_mla_with_kvcache=module.flash_mla_with_kvcache), ""
