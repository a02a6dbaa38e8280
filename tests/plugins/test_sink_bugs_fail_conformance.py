"""Planted attention-sink bugs fail ``attnplug check``'s sink case, naming it (one suite
session for the three planted copies of torch_native, ``broken_sink_backends.py``).

``slow`` (about 8 s: a whole conformance session); the sink cases themselves run by default
in every backend's conformance run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent
PLANTED = {"DropsSinks": "drops_sinks", "SinkInNumerator": "sink_in_numerator",
           "SinkWithoutScale": "sink_without_scale"}


@pytest.mark.slow
def test_each_planted_sink_bug_fails_naming_the_case(pytester):
    pytester.syspathinsert(HERE)
    backends = [arg for cls in PLANTED for arg in ("--attnplug-backend", f"broken_sink_backends:{cls}")]
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "attnplug.plugins.conformance",
                                          *backends, "-k", "test_outputs_match_reference and sink_logits_gqa")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    out = result.stdout.str()
    assert result.parseoutcomes().get("failed") == len(PLANTED), out
    for cls, name in PLANTED.items():
        result.stdout.fnmatch_lines([f"FAILED *test_outputs_match_reference?broken_sink_backends:{cls}-sink_logits_gqa]*"])
        assert f"case 'sink_logits_gqa' on backend {name!r}" in out, out
    assert "differ from the torch_native reference" in out, out
