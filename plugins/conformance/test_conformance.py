"""The conformance suite: every case of ``cases.CASES`` (plus ``--attnplug-cases``) on every
``--attnplug-backend``, through the runner path, against torch_native.

Test ids are ``test_<property>[<backend>-<case>]``; a failure message starts with the
case's name and JSON, then lists each problem with its step, cache group, request and
position.
"""

from __future__ import annotations

import pytest
import torch

from attnplug.core.contracts import PLUGIN_API_VERSION, AttentionLayerConfig
from attnplug.plugins.conformance import backend_checks, checks
from attnplug.plugins.registry import check_api_version

pytestmark = pytest.mark.attnplug_conformance


def _fail(run, problems: list[str], what: str) -> None:
    lines = "\n".join(f"  - {p}" for p in problems)
    pytest.fail(f"{checks.header(run)}\n{what}:\n{lines}", pytrace=False)


def _run(session, spec, case, repeat: int = 0):
    backend, a = session.prepare(spec, case)
    run = session.run(backend, case, a.kernel_block_size, repeat=repeat)
    if run.error:
        _fail(run, [run.error], "running the case raised")
    return backend, run


def test_outputs_match_reference(attnplug_conformance, attnplug_backend, conformance_case):
    """Every step's output, in both cache groups, matches torch_native within the dtype's tolerance."""
    backend, run = _run(attnplug_conformance, attnplug_backend, conformance_case)
    problems = checks.check_outputs(run, attnplug_conformance.reference(backend, conformance_case))
    if problems:
        _fail(run, problems, "outputs differ from the reference")


def test_kv_written_exactly_at_slot_mapping(attnplug_conformance, attnplug_backend, conformance_case):
    """K/V land at their slots; no other byte of the poisoned cache changes (padding included)."""
    backend, run = _run(attnplug_conformance, attnplug_backend, conformance_case)
    problems = checks.check_cache_writes(run, backend)
    if problems:
        _fail(run, problems, "KV-cache writes are wrong")


def test_builders_do_not_mutate_metadata(attnplug_conformance, attnplug_backend, conformance_case):
    """``build``/``update_block_table`` leave the CommonAttentionMetadata (and the metadata
    they copy from) exactly as they got it."""
    _, run = _run(attnplug_conformance, attnplug_backend, conformance_case)
    problems = checks.check_metadata_untouched(run)
    if problems:
        _fail(run, problems, "metadata was mutated")


def test_update_block_table_equals_fresh_build(attnplug_conformance, attnplug_backend, conformance_case):
    """For builders that support it, ``update_block_table`` == a fresh ``build`` (fields and forward)."""
    _, run = _run(attnplug_conformance, attnplug_backend, conformance_case)
    problems = checks.check_update_block_table(run)
    if problems is None:
        pytest.skip("the builder declares supports_update_block_table = False")
    if problems:
        _fail(run, problems, "update_block_table() disagrees with build()")


def _deterministic_cases(case) -> bool:
    return case.check_determinism


def test_deterministic(attnplug_conformance, attnplug_backend, conformance_case):
    """Running the same case twice gives bit-identical outputs and caches."""
    if not conformance_case.check_determinism:
        pytest.skip(f"case {conformance_case.name!r} is not a determinism case")
    _, first = _run(attnplug_conformance, attnplug_backend, conformance_case)
    _, second = _run(attnplug_conformance, attnplug_backend, conformance_case, repeat=1)
    problems = checks.check_same_runs(first, second)
    if problems:
        _fail(first, problems, "the backend is not deterministic")


test_deterministic._attnplug_case_filter = _deterministic_cases


def test_declarations_are_well_formed(attnplug_conformance, attnplug_backend):
    """Capabilities have the documented types; ``split_kv_cache`` views the cache it is given."""
    backend = attnplug_conformance.backends[attnplug_backend]
    problems = []
    why = check_api_version(backend.plugin_api_version)
    if why:
        problems.append(f"plugin_api_version: {why}")
    feats = backend.features()
    if not (isinstance(feats, dict) and all(isinstance(k, str) and isinstance(v, bool) for k, v in feats.items())):
        problems.append(f"features() must return dict[str, bool], got {feats!r}")
    elif not {"sliding_window", "logits_soft_cap", "mqa_gqa"} <= set(feats):
        problems.append(f"features() must include sliding_window, logits_soft_cap, mqa_gqa; got {sorted(feats)}")
    avail = backend.is_available()
    if not (isinstance(avail, tuple) and len(avail) == 2 and isinstance(avail[0], bool) and isinstance(avail[1], str)):
        problems.append(f"is_available() must return (bool, str), got {avail!r}")
    if backend.kv_cache_kind == "attention":
        shape = backend.get_kv_cache_shape(3, 4, 2, 8)
        if not (isinstance(shape, tuple) and all(isinstance(s, int) for s in shape)):
            problems.append(f"get_kv_cache_shape() must return a tuple of ints, got {shape!r}")
        else:
            cache = torch.zeros(shape)
            k, v = backend.split_kv_cache(cache)
            for name, half in (("key", k), ("value", v)):
                if tuple(half.shape) != (3, 4, 2, 8):
                    problems.append(f"split_kv_cache() {name} view has shape {tuple(half.shape)}, expected "
                                    "[num_blocks=3, block_size=4, num_kv_heads=2, head_size=8]")
            if not problems:
                k[1, 2, 1, 3], v[2, 0, 0, 7] = 1.0, 2.0
                if float(cache.sum()) != 3.0:
                    problems.append("split_kv_cache() must return views of the cache (writes must reach it)")
    if problems:
        pytest.fail(f"backend {attnplug_backend!r} (plugin API {PLUGIN_API_VERSION}):\n"
                    + "\n".join(f"  - {p}" for p in problems), pytrace=False)


def _attention_backend(session, spec):
    """The backend of ``spec`` and its device; skips what the attention suite cannot run."""
    from attnplug.plugins.conformance.requirements import untestable_reason

    backend = session.backends[spec]
    if backend.kv_cache_kind != "attention":
        pytest.skip(f"the backend serves {backend.kv_cache_kind!r} caches")
    why = untestable_reason(backend, session.device(backend))
    if why:
        pytest.skip(why)
    return backend, session.device(backend)


def test_builder_is_reentrant(attnplug_conformance, attnplug_backend):
    """Case ``reentrant_builds``: one builder builds three steps before any runs; each forward
    then equals a build right before it (``backend_checks.check_reentrant``)."""
    backend, device = _attention_backend(attnplug_conformance, attnplug_backend)
    problems = backend_checks.check_reentrant(backend, device)
    if problems:
        pytest.fail(f"backend {attnplug_backend!r}: the builder is not re-entrant:\n"
                    + "\n".join(f"  - {p}" for p in problems), pytrace=False)


def test_kv_layout_matches_cache_shape(attnplug_conformance, attnplug_backend):
    """The declared ``kv_cache_layout`` is what ``get_kv_cache_shape`` / ``split_kv_cache`` do
    (``backend_checks.check_kv_layout``)."""
    backend = attnplug_conformance.backends[attnplug_backend]
    if backend.kv_cache_kind != "attention":
        pytest.skip(f"the backend serves {backend.kv_cache_kind!r} caches")
    if getattr(backend, "kv_cache_layout", None) is None:
        pytest.skip("the backend declares no kv_cache_layout: its packing is one the descriptor cannot say "
                    "(e.g. vllm:CPU_ATTN's transposed K); split_kv_cache alone says where K and V are")
    problems = backend_checks.check_kv_layout(backend)
    if problems:
        pytest.fail(f"backend {attnplug_backend!r}: the KV layout descriptor disagrees with the cache:\n"
                    + "\n".join(f"  - {p}" for p in problems), pytrace=False)


@pytest.mark.parametrize("feature, layer", [
    ("sliding_window", dict(sliding_window=8)),
    ("logits_soft_cap", dict(logits_soft_cap=30.0)),
    ("mqa_gqa", dict(num_heads=4, num_kv_heads=1)),
    ("sinks", dict(has_sinks=True)),
    ("alibi", dict(use_alibi=True)),
])
def test_validate_configuration_rejects_undeclared_features(attnplug_conformance, attnplug_backend, feature, layer):
    """A feature the backend declares it lacks must be rejected by ``validate_configuration``
    (selection relies on it; silently serving it wrong is the bug this prevents)."""
    backend = attnplug_conformance.backends[attnplug_backend]
    if backend.kv_cache_kind != "attention":
        pytest.skip(f"the backend serves {backend.kv_cache_kind!r} caches")
    if backend.features().get(feature, False):
        pytest.skip(f"the backend declares {feature!r}; the cases test it")
    cfg = AttentionLayerConfig(**{"num_heads": 4, "num_kv_heads": 2, "head_size": 64, **layer})
    if not backend.validate_configuration(cfg):
        pytest.fail(f"backend {attnplug_backend!r} declares features()[{feature!r}] = False but "
                    f"validate_configuration({cfg}) accepts it", pytrace=False)
