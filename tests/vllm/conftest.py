"""``tests/vllm/``: vLLM must be installed where ``ATTNPLUG_REQUIRE_VLLM=1`` (``make test``
installs ``plugins/vllm/requirements-cpu.txt`` and sets it); elsewhere these tests skip."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def vllm_bridge():
    """``attnplug.plugins.vllm._vllm`` (vLLM imported, version checked). The environment
    variables importing vLLM sets (``TORCHINDUCTOR_COMPILE_THREADS``...) are put back so
    that later tests of the session run as without it."""
    saved = dict(os.environ)
    try:
        import attnplug.plugins.vllm.adapter  # noqa: F401
        from attnplug.plugins.vllm import _vllm
    except ImportError as exc:
        if os.environ.get("ATTNPLUG_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM is not importable ({exc}) but ATTNPLUG_REQUIRE_VLLM=1: "
                        "pip install --no-deps -r plugins/vllm/requirements-cpu.txt", pytrace=False)
        pytest.skip(f"vLLM not installed ({exc}); pip install --no-deps -r plugins/vllm/requirements-cpu.txt")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return _vllm
