"""The triton backend (kernels in the Triton interpreter, fp32) with multi-token decode:
verifying rows of query length ``1 + k`` match the dense reference, full attention and a
sliding window (see ``tests/backends/test_spec_decode_builders.py``)."""

from __future__ import annotations


import pytest
import torch

from spec_verify_cases import batch, dense_reference, run_backend  # noqa: E402 (tests/backends/conftest.py registers it)


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_triton_verifying_rows_match_the_dense_reference(window):
    from attnplug.backends.triton import TritonBackend

    b = batch("verify-mixed", block_size=16)
    torch.testing.assert_close(run_backend(TritonBackend, b, window), dense_reference(b, window), atol=1e-4, rtol=1e-4)
