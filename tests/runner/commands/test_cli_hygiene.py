"""CLI hygiene (issue 19): --version, defaults in every --help, one-line usage errors,
no PytestAssertRewriteWarning from `attnplug check`, --cases checked before pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attnplug.runner.commands.cli import SUBCOMMANDS, main as cli


def test_version(capsys):
    import attnplug

    assert cli(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"attnplug {attnplug.__version__}"


@pytest.mark.parametrize("cmd,shown", [("run", "(default: "), ("explain", "--check"), ("backends", "(default: 16)"),
                                       ("check", "(default: auto)"), ("parity", "(default: 6)"),
                                       ("bench", "(default: 300)")])
def test_help_shows_defaults(capsys, cmd, shown):
    """explain has no option with a default (its only option is the flag --check)."""
    assert cmd in SUBCOMMANDS
    with pytest.raises(SystemExit) as done:
        cli([cmd, "--help"])
    assert done.value.code == 0
    assert shown in " ".join(capsys.readouterr().out.split()), cmd


@pytest.mark.parametrize("argv", [["parity", "--hf-config", "x", "--num-requests", "many"], ["check"],
                                  ["bench", "--steps", "x"], ["parity", "--bogus"]])
def test_usage_errors_are_one_line_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as done:
        cli(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"attnplug {argv[0]}: error: ")


def test_check_has_no_assert_rewrite_warning(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the `-p` path
    res = subprocess.run([sys.executable, "-m", "attnplug", "check", "torch_native", "-k", "prefill_only"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    assert "PytestAssertRewriteWarning" not in res.stdout + res.stderr


@pytest.mark.parametrize("content,says", [(None, "no such file"), ("{", "not valid JSON"),
                                          ('{"name": "x"}', "expected a JSON list"),
                                          ('[{"name": "x", "bogus": 1}]', "unknown keys ['bogus']")])
def test_cases_file_is_checked_before_pytest(capsys, monkeypatch, tmp_path, content, says):
    path = tmp_path / "cases.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(pytest, "main", lambda *a, **k: pytest.fail("pytest.main ran"))
    assert cli(["check", "torch_native", "--cases", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"attnplug check: --cases {path}: ") and says in err


def test_a_valid_cases_file_passes_the_check(tmp_path):
    from attnplug.runner.commands.check import cases_file_problem

    path = tmp_path / "cases.json"
    path.write_text(json.dumps([{"name": "mine", "requests": [[0, 3], [2, 1]]}]))
    assert cases_file_problem(str(path)) is None
