"""Fixtures shared by the backend tests.

It also registers ``tests/backends/spec_verify_cases.py`` as the module ``spec_verify_cases``
(loaded by path) for the speculative-decoding builder tests here and in ``triton/``, and
``gdn_stepper.py`` (the GDN impl stepper) for ``state/`` and ``triton/``: putting
``tests/backends`` on ``sys.path`` instead would make its ``flash_attn`` / ``flashinfer`` test
folders importable namespace packages, and the flash_attn backend would then report
"flash_attn 0 is too old"."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

import pytest


def _register(name: str) -> None:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_register("spec_verify_cases")
_register("gdn_stepper")


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
