"""Fixtures shared by the backend tests."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Callable

import pytest


@pytest.fixture
def probe_with(monkeypatch) -> Callable[..., tuple[Any, str]]:
    """``probe_with(kernels_module, {"name": module_or_None, ...})``: run that kernels module's
    cached ``_probe()`` as if exactly those top-level packages were installed (``None``: not
    installed), and return its ``(found, reason)``; the cache is cleared before and after."""

    def probe(kernels, modules: dict[str, Any]) -> tuple[Any, str]:
        real_find_spec = importlib.util.find_spec
        monkeypatch.setattr(kernels.importlib.util, "find_spec",
                            lambda name, *a: (None if modules[name] is None else object()) if name in modules
                            else real_find_spec(name, *a))
        for name, module in modules.items():
            if module is not None:
                monkeypatch.setitem(sys.modules, name, module)
        kernels._probe.cache_clear()
        try:
            return kernels._probe()
        finally:
            kernels._probe.cache_clear()

    return probe
