"""``attnplug check``: ``package.module:Class`` imports from the working directory (a console
script does not put it on ``sys.path``), a planted "ignores the softmax scale" impl fails
naming the case, and ``--json`` is a machine-readable summary on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnplug.runner.commands.cli import main as cli

HERE = Path(__file__).resolve().parent
SCRIPT = Path(sys.executable).with_name("attnplug")


@pytest.mark.skipif(not SCRIPT.exists(), reason="needs the installed `attnplug` console script")
def test_the_console_script_checks_a_backend_of_the_working_directory_and_reports_json():
    spec = "broken_backends:IgnoresScale"   # tests/plugins/broken_backends.py, not installed anywhere
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    res = subprocess.run([str(SCRIPT), "check", spec, "-k", "outputs and (decode_only or scale_one)", "--json"],
                         cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert report["exit_status"] == 1 and report["backends"] == [spec]
    assert report["counts"] == {"passed": 1, "failed": 1, "skipped": 0}, report["counts"]
    assert report["failed_cases"] == {spec: ["scale_one"]}
    failed = next(t for t in report["tests"] if t["outcome"] == "failed")
    assert (failed["test"], failed["backend"], failed["case"]) == ("test_outputs_match_reference", spec, "scale_one")
    assert "case 'scale_one' on backend 'ignores_scale'" in failed["message"]
    assert "differ from the torch_native reference" in failed["message"]
    assert "FAILED" in res.stderr and "scale_one" in res.stderr   # pytest's own report went to stderr


def test_a_module_that_cannot_be_imported_names_the_working_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(["check", "no_such_module_39:Backend", "--json"]) == 2
    captured = capsys.readouterr()
    assert f"looked in the working directory {tmp_path} and on sys.path" in captured.err
    assert json.loads(captured.out) == {"exit_status": 2, "error": captured.err.strip().removeprefix(
        "attnplug check: ")}
