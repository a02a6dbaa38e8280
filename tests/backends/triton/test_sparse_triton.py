"""The triton_indexer and triton_sparse_mla backends in the Triton interpreter (fp32): their
sparse conformance checks against the float64 references with NaN-poisoned caches, and the
same indices / outputs as the torch_native references."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.sparse.torch_native.backend import TorchNativeIndexerBackend, TorchNativeSparseMLABackend
from attnplug.backends.sparse.triton.backend import TritonIndexerBackend, TritonSparseMLABackend
from attnplug.plugins.conformance import sparse_checks
from attnplug.plugins.conformance.sparse_cases import SELECTOR_CASES, SPARSE_MLA_CASES
from attnplug.plugins.conformance.sparse_harness import SelectorStep, SparseMLAStep

SELECTOR = {c.name: c for c in SELECTOR_CASES}
CONSUMER = {c.name: c for c in SPARSE_MLA_CASES}


@pytest.mark.parametrize("name", ["block4_topk3", "ties"])
def test_triton_selector_passes_the_selector_checks_and_equals_the_reference(name):
    step = SelectorStep(TritonIndexerBackend, SELECTOR[name], "cpu")
    run = step.run()
    assert sparse_checks.check_selection(step, run) + sparse_checks.check_key_cache(run) == []
    ref = SelectorStep(TorchNativeIndexerBackend, SELECTOR[name], "cpu").run()
    assert torch.equal(run.indices, ref.indices)


@pytest.mark.parametrize("name", ["block4_topk3", "padded_rows"])
def test_triton_sparse_mla_passes_the_consumer_checks(name):
    step = SparseMLAStep(TritonSparseMLABackend, CONSUMER[name], "cpu")
    run = step.run()
    assert sparse_checks.check_sparse_output(step, run) == []
    ref = SparseMLAStep(TorchNativeSparseMLABackend, CONSUMER[name], "cpu").run()
    torch.testing.assert_close(run.output, ref.output, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("case", SELECTOR_CASES + SPARSE_MLA_CASES, ids=lambda c: f"{type(c).__name__}-{c.name}")
def test_triton_sparse_backends_pass_every_case(case):
    if hasattr(case, "index_n_heads"):
        step = SelectorStep(TritonIndexerBackend, case, "cpu")
        run = step.run()
        assert sparse_checks.check_selection(step, run) + sparse_checks.check_key_cache(run) == []
    else:
        step = SparseMLAStep(TritonSparseMLABackend, case, "cpu")
        assert sparse_checks.check_sparse_output(step, step.run()) == []
