"""docs/feature-matrix.md is exactly what ``attnplug backends --matrix`` prints (regenerate
it with that command when a declaration changes), and the matrix reads the declarations
selection checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.core.capabilities import BackendCapabilities, Feature
from attnplug.runner.commands.feature_matrix import feature_matrix_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "feature-matrix.md"


def test_the_feature_matrix_page_is_not_stale():
    from attnplug.backends.flash_attn.kernels import installed_version

    if installed_version() == 3:  # the page shows the reference machine's flash_attn row (its header says so)
        pytest.skip("FlashAttention 3 is installed: flash_attn declares its FA3 block sizes and graph level here")
    # A fresh process without TRITON_INTERPRET: triton's declarations depend on the mode its
    # first import fixes (cpu and no bfloat16 under the interpreter); the page shows the compiled mode.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "attnplug", "backends", "--matrix"], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    assert out == DOC.read_text(), ("docs/feature-matrix.md is stale: regenerate it with "
                                    "`attnplug backends --matrix > docs/feature-matrix.md`")


def test_a_declaration_changes_the_matrix():
    plain = BackendCapabilities.of(TorchNativeBackend)
    no_sinks = type("NoSinks", (TorchNativeBackend,), {"supports_sink": classmethod(lambda cls: False)})
    changed = BackendCapabilities.of(no_sinks)
    assert Feature.SINKS in plain.features and Feature.SINKS not in changed.features
    assert feature_matrix_markdown([plain]) != feature_matrix_markdown([changed])
