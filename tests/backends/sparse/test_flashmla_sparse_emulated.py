"""``flashmla_sparse``'s lowering against the CPU emulator of FlashMLA's documented
``flash_mla_sparse_fwd`` contract: it passes the sparse MLA conformance family (heads padded
to 64, -1 skipped, the base-2 LSE turned natural), and the emulator refuses what the real
kernel refuses."""

from __future__ import annotations

import math

import pytest
import torch

from attnplug.backends.emulators.mla_kernels import MLAContractError
from attnplug.backends.emulators.sparse_backends import FlashMLASparseEmulatedBackend
from attnplug.backends.emulators.sparse_kernels import flash_mla_sparse_fwd
from attnplug.backends.sparse.torch_native.backend import TorchNativeSparseMLABackend
from attnplug.core.sparse import SparseMLALayerConfig
from attnplug.plugins.conformance import sparse_checks
from attnplug.plugins.conformance.sparse_cases import SPARSE_MLA_CASES
from attnplug.plugins.conformance.sparse_harness import SparseMLAStep


@pytest.mark.parametrize("case", SPARSE_MLA_CASES, ids=lambda c: c.name)
def test_lowering_passes_the_sparse_mla_checks(case):
    step = SparseMLAStep(FlashMLASparseEmulatedBackend, case, "cpu")
    assert sparse_checks.check_sparse_output(step, step.run()) == []


def test_lse_is_the_natural_log_of_the_reference():
    cfg = SparseMLALayerConfig(4, 32, 16, 16, 16, index_topk=4)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 4, 48, generator=g)
    q = torch.randn(2, 4, 48, generator=g)
    slots = torch.tensor([[5, -1, 0, 11], [-1, -1, -1, -1]])
    o, lse = FlashMLASparseEmulatedBackend.get_impl_cls()(cfg, 0.2).forward_sparse(q, cache, slots)
    want_o, want_lse = TorchNativeSparseMLABackend.get_impl_cls()(cfg, 0.2).forward_sparse(q, cache, slots)
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    assert bool(torch.isneginf(lse[:, 1]).all()) and not o[1].any()


@pytest.mark.parametrize("change, words", [
    (dict(heads=4), "h_q must be a multiple of 64"),
    (dict(index_dtype=torch.int64), "indices must be int32"),
    (dict(kv_heads=2), "kv must be [s_kv, 1, 48]"),
])
def test_the_emulator_refuses_what_the_kernel_refuses(change, words):
    heads, kv_heads = change.get("heads", 64), change.get("kv_heads", 1)
    q = torch.zeros(2, heads, 48)
    kv = torch.zeros(10, kv_heads, 48)
    idx = torch.zeros(2, 1, 4, dtype=change.get("index_dtype", torch.int32))
    with pytest.raises(MLAContractError, match=words.replace("[", r"\[")):
        flash_mla_sparse_fwd(q, kv, idx, 1 / math.sqrt(48), 32)
