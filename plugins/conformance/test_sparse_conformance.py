"""The sparse-attention part of the conformance suite: the selector family on every
``--attnplug-backend`` that serves ``"indexer"`` caches, the consumer family on every
sparse MLA backend (``kv_cache_kind`` ``"mla"`` with ``sparse = True``), against float64
references (``sparse_harness``) with NaN-poisoned caches.

Test ids are ``test_selector_<property>[<backend>-<case>]`` and
``test_sparse_mla_<property>[<backend>-<case>]``.
"""

from __future__ import annotations

import pytest

from attnplug.plugins.conformance import sparse_checks
from attnplug.plugins.conformance.sparse_harness import SelectorStep, SparseMLAStep

pytestmark = pytest.mark.attnplug_conformance


def _prepared(session, spec, case, step_cls, selector: bool):
    backend = session.backends[spec]
    if selector and backend.kv_cache_kind != "indexer":
        pytest.skip(f"the backend serves {backend.kv_cache_kind!r} caches; these are selector (indexer) cases")
    if not selector and not getattr(backend, "sparse", False):
        pytest.skip("the backend is not a sparse MLA backend; these are sparse MLA cases")
    step = step_cls(backend, case, session.device(backend))
    reasons = backend.validate_configuration(step.layer_cfg)
    if reasons:
        pytest.skip(f"case {case.name!r}: " + "; ".join(reasons))
    return step


def _fail(spec: str, problems: list[str], what: str) -> None:
    if problems:
        pytest.fail(f"backend {spec!r}: {what}:\n" + "\n".join(f"  - {p}" for p in problems[:12]), pytrace=False)


def test_selector_topk_matches_reference(attnplug_conformance, attnplug_backend, selector_case):
    """Each query's indices: own request, causal, a top-k of the reference scores, ties to the
    lower position, -1 after; padded rows -1 (NaN-poisoned rows never selected)."""
    step = _prepared(attnplug_conformance, attnplug_backend, selector_case, SelectorStep, True)
    _fail(attnplug_backend, sparse_checks.check_selection(step, step.run()), "selection breaks the contract")


def test_selector_keys_written_exactly_at_slot_mapping(attnplug_conformance, attnplug_backend, selector_case):
    step = _prepared(attnplug_conformance, attnplug_backend, selector_case, SelectorStep, True)
    _fail(attnplug_backend, sparse_checks.check_key_cache(step.run()), "the indexer cache is wrong")


def test_sparse_mla_equals_dense_with_others_masked(attnplug_conformance, attnplug_backend, sparse_mla_case):
    """Sparse attention at the given indices equals dense attention with every other key
    masked; -1 entries ignored; no poisoned row read; padded rows untouched."""
    step = _prepared(attnplug_conformance, attnplug_backend, sparse_mla_case, SparseMLAStep, False)
    _fail(attnplug_backend, sparse_checks.check_sparse_output(step, step.run()), "sparse MLA output is wrong")
