"""Property mode (``attnplug check NAME --hypothesis N``): random cases within the declarations
pass on torch_native; a broken backend fails, and the shrunk case JSON it prints reproduces
the failure through ``--cases``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnplug.runner.commands.check import parse, pytest_args

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent


def _run_suite(pytester, backend: str, *extra: str):
    pytester.syspathinsert(HERE)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "attnplug.plugins.conformance",
                                        "--attnplug-backend", backend, *extra)


def test_check_hypothesis_runs_only_the_property_test(tmp_path):
    args = pytest_args(parse(["torch_native", "--hypothesis", "7"]), str(tmp_path / "pytest.ini"))
    at = args.index("--attnplug-hypothesis")
    assert args[at + 1] == "7" and args[args.index("-k") + 1] == "test_property_mode_random_cases"
    with pytest.raises(SystemExit):
        parse(["torch_native", "--hypothesis", "-2"])


def test_random_cases_pass_on_torch_native(pytester):
    result = _run_suite(pytester, "torch_native", "--attnplug-hypothesis", "4", "-k", "random_cases")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert result.parseoutcomes().get("passed") == 1


def test_a_failure_is_shrunk_and_its_json_reproduces_it(pytester, tmp_path):
    result = _run_suite(pytester, "broken_backends_more:WritesIntoACopy", "--attnplug-hypothesis", "5",
                        "-k", "random_cases")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    out = result.stdout.str()
    assert "property mode: backend 'broken_backends_more:WritesIntoACopy' fails a random case; shrunk to" in out
    line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith('[{"name":"hypothesis_case"'))
    (case,) = json.loads(line)
    assert len(case["requests"]) == 1 and case["num_pad_tokens"] == 0, case   # shrunk: one request, no padding
    path = tmp_path / "cases.json"
    path.write_text(line)
    again = _run_suite(pytester, "broken_backends_more:WritesIntoACopy", "--attnplug-cases", str(path),
                       "-k", "hypothesis_case and kv_written")
    assert again.ret == pytest.ExitCode.TESTS_FAILED and "the step wrote none of its" in again.stdout.str()
