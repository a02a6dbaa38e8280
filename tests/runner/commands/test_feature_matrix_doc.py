"""docs/feature-matrix.md is exactly what ``attnplug backends --matrix`` prints (regenerate
it with that command when a declaration changes), and the matrix reads the declarations
selection checks."""

from __future__ import annotations

from pathlib import Path

import pytest

import attnplug.backends.mla.triton.backend as triton_mla_backend
import attnplug.backends.sparse.triton.backend as triton_sparse_backend
import attnplug.backends.triton.backend as triton_backend
import attnplug.backends.triton.runtime as triton_runtime
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.core.capabilities import BackendCapabilities, Feature
from attnplug.plugins.discovery import get_registry
from attnplug.runner.commands.feature_matrix import builtin_capabilities, feature_matrix_markdown

DOC = Path(__file__).resolve().parents[3] / "docs" / "feature-matrix.md"


def test_the_feature_matrix_page_is_not_stale(monkeypatch):
    from attnplug.backends.flash_attn.kernels import installed_version

    if installed_version() == 3:  # the page shows the reference machine's flash_attn row (its header says so)
        pytest.skip("FlashAttention 3 is installed: flash_attn declares its FA3 block sizes and graph level here")
    # triton's declarations depend on the mode its first import fixed (the CPU and no bfloat16
    # under the interpreter, which tests/backends/triton/conftest.py turns on for the whole
    # session): the page shows the compiled mode
    for module in (triton_runtime, triton_backend, triton_mla_backend, triton_sparse_backend):  # gdn reads runtime
        monkeypatch.setattr(module, "interpreting", lambda: False)
    assert feature_matrix_markdown(builtin_capabilities(get_registry())) == DOC.read_text(), (
        "docs/feature-matrix.md is stale: regenerate it with `attnplug backends --matrix > docs/feature-matrix.md`")


def test_a_declaration_changes_the_matrix():
    plain = BackendCapabilities.of(TorchNativeBackend)
    no_sinks = type("NoSinks", (TorchNativeBackend,), {"supports_sink": classmethod(lambda cls: False)})
    changed = BackendCapabilities.of(no_sinks)
    assert Feature.SINKS in plain.features and Feature.SINKS not in changed.features
    assert feature_matrix_markdown([plain]) != feature_matrix_markdown([changed])
