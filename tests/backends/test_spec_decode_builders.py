"""Builders with multi-token decode (speculative decoding): verifying rows of query length
``1 + k`` — each query position its own causal, bottom-right-aligned span (and, with a
sliding window, its own window) — give the dense reference's output on torch_native, the
flash_attn (FA3) emulator and the flashinfer lowering (emulated kernels). The triton
kernels' version of this test is ``tests/backends/triton/test_spec_decode_triton.py``.

FlashInfer keeps ``reorder_batch_threshold = 1``: its decode wrapper takes one query per
request, so verifying rows run in the prefill wrapper (causal, bottom-right) after the
one-token decodes; the case layouts put the decodes first, as the runner does.
"""

from __future__ import annotations


import pytest
import torch

from attnplug.backends.emulators import FlashAttn3EmulatedBackend, FlashInferEmulatedBackend
from attnplug.backends.torch_native import TorchNativeBackend

from spec_verify_cases import CASES, batch, dense_reference, run_backend  # noqa: E402 (tests/backends/conftest.py registers it)

BACKENDS = {"torch_native": TorchNativeBackend, "flash_attn3_emulated": FlashAttn3EmulatedBackend,
            "flashinfer_emulated": FlashInferEmulatedBackend}


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_verifying_rows_match_the_dense_reference(name, case, window):
    b = batch(case)
    want = dense_reference(b, window)
    got = run_backend(BACKENDS[name], b, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)

