"""The triton backend (kernels in the Triton interpreter, fp32) with multi-token decode:
verifying rows of query length ``1 + k`` match the dense reference, full attention and a
sliding window (see ``tests/backends/test_spec_decode_builders.py``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

def _load_cases():
    """``tests/backends/spec_verify_cases.py`` by path: putting ``tests/backends`` on ``sys.path``
    would make its ``flash_attn`` / ``flashinfer`` test folders importable namespace packages
    (and the flash_attn backend would then report "flash_attn 0 is too old")."""
    if "spec_verify_cases" not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "spec_verify_cases.py"
        spec = importlib.util.spec_from_file_location("spec_verify_cases", path)
        sys.modules["spec_verify_cases"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["spec_verify_cases"]


_cases = _load_cases()
batch = _cases.batch
dense_reference = _cases.dense_reference
run_backend = _cases.run_backend


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_triton_verifying_rows_match_the_dense_reference(window):
    from attnplug.backends.triton import TritonBackend

    b = batch("verify-mixed", block_size=16)
    torch.testing.assert_close(run_backend(TritonBackend, b, window), dense_reference(b, window), atol=1e-4, rtol=1e-4)
