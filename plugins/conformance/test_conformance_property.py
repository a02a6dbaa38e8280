"""Property mode of the conformance suite: ``--attnplug-hypothesis N`` (``attnplug check NAME
--hypothesis N``) draws N random attention cases within each backend's declarations
(``property.py``), runs every check on each, and on a failure prints the shrunk case's
JSON for ``--cases``."""

from __future__ import annotations

import json

import pytest

from attnplug.plugins.conformance import checks

pytestmark = pytest.mark.attnplug_conformance


def test_property_mode_random_cases(attnplug_conformance, attnplug_backend, request):
    """N random cases (shapes, dtypes, windows, block orders, decode/prefill mixes, padding)
    pass every check; a failure is shrunk and printed as case JSON."""
    n = request.config.getoption("attnplug_hypothesis")
    if not n:
        pytest.skip("property mode is off: pass --attnplug-hypothesis N (attnplug check NAME --hypothesis N)")
    from hypothesis import HealthCheck, given, settings

    from attnplug.plugins.conformance.property import case_problems, case_strategy

    backend = attnplug_conformance.backends[attnplug_backend]
    if backend.kv_cache_kind != "attention":
        pytest.skip(f"the backend serves {backend.kv_cache_kind!r} caches; property mode draws attention cases")
    device = attnplug_conformance.device(backend)
    failures: list = []

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case_strategy(backend))
    def holds(case):
        problems = case_problems(backend, case, device, name_blocks=False)
        if problems:
            failures.append((case, problems))
            raise AssertionError(problems[0])

    try:
        holds()
    except AssertionError:
        if not failures:
            raise
        case = failures[-1][0]   # hypothesis replays the shrunk example last
        problems = case_problems(backend, case, device) or failures[-1][1]
        lines = "\n".join(f"  - {p}" for p in problems[:checks.MAX_LISTED])
        pytest.fail(f"property mode: backend {attnplug_backend!r} fails a random case; shrunk to\n"
                    f"  case JSON (save as a list in FILE.json and rerun with --cases FILE.json -k {case.name}):\n"
                    f"  {json.dumps([case.to_dict()], separators=(',', ':'))}\n{lines}", pytrace=False)
