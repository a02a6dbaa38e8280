"""The MLA part of the conformance suite: every case of ``mla_cases.MLA_CASES`` on every
``--attnplug-backend`` that serves ``"mla"`` caches, against the float64 expanded
reference (``mla_harness.reference_output``), with a NaN-poisoned cache.

Test ids are ``test_mla_<property>[<backend>-<case>]``; backends of other kinds skip them
with their ``kv_cache_kind``, as MLA backends skip the attention and state cases.
"""

from __future__ import annotations

import pytest

from attnplug.plugins.conformance import mla_checks
from attnplug.plugins.conformance.mla_harness import MLAStep

pytestmark = pytest.mark.attnplug_conformance


def _backend(session, spec):
    backend = session.backends[spec]
    if backend.kv_cache_kind != "mla":
        pytest.skip(f"the backend serves {backend.kv_cache_kind!r} caches; these are MLA cases")
    if getattr(backend, "sparse", False):
        pytest.skip("a sparse MLA backend (no forward_mqa / forward_mha): the sparse_mla cases test it")
    return backend, session.device(backend)


def _step(session, spec, case) -> MLAStep:
    backend, device = _backend(session, spec)
    step = MLAStep(backend, case, device)
    reasons = backend.validate_configuration(step.layer_cfg)
    if reasons:
        pytest.skip(f"case {case.name!r}: " + "; ".join(reasons))
    return step


def _fail(spec: str, problems: list[str], what: str) -> None:
    if problems:
        pytest.fail(f"backend {spec!r}: {what}:\n" + "\n".join(f"  - {p}" for p in problems), pytrace=False)


def test_mla_outputs_match_reference(attnplug_conformance, attnplug_backend, mla_case):
    """Real rows equal the expanded float64 reference (no NaN: no poisoned row was read);
    padded rows are left as they were."""
    step = _step(attnplug_conformance, attnplug_backend, mla_case)
    _fail(attnplug_backend, mla_checks.check_outputs(step, step.run()), "outputs differ from the reference")


def test_mla_latent_written_exactly_at_slot_mapping(attnplug_conformance, attnplug_backend, mla_case):
    """Each real token's slot holds ``[kv_c_normed | k_pe]`` bit for bit; no other row changes."""
    step = _step(attnplug_conformance, attnplug_backend, mla_case)
    _fail(attnplug_backend, mla_checks.check_cache(step.run()), "the latent cache is wrong")


def test_mla_absorbed_decode_equals_expanded_prefill(attnplug_conformance, attnplug_backend):
    """Decodes through ``forward_mqa`` (W_UK / W_UV absorbed) equal the same step through
    ``forward_mha`` (keys and values up-projected)."""
    backend, device = _backend(attnplug_conformance, attnplug_backend)
    _fail(attnplug_backend, mla_checks.check_absorbed_equals_expanded(backend, device),
          "absorbed decode and expanded prefill disagree")


def test_mla_chunked_context_equals_one_shot(attnplug_conformance, attnplug_backend):
    """A prefill whose context passes through a tiny workspace (many chunks, merged by LSE)
    equals the one-chunk result and the reference."""
    backend, device = _backend(attnplug_conformance, attnplug_backend)
    _fail(attnplug_backend, mla_checks.check_chunked_equals_one_shot(backend, device),
          "chunked-context prefill is wrong")


def test_mla_builder_is_reentrant(attnplug_conformance, attnplug_backend):
    """N builds by one builder, then N forwards, equal N (build, forward) pairs."""
    backend, device = _backend(attnplug_conformance, attnplug_backend)
    _fail(attnplug_backend, mla_checks.check_reentrant(backend, device), "the builder is not re-entrant")
