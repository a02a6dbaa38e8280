"""The example third-party plugin, installed for real: listed with its distribution,
selectable by config, and passing `attnplug check`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnplug.core import AttentionLayerConfig
from attnplug.plugins import select_backend
from attnplug.plugins.discovery import load_registry

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "plugin-example"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """``pip install --no-deps --target`` of a copy of the example (the source tree stays clean)."""
    tmp = tmp_path_factory.mktemp("example")
    src = tmp / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, capture_output=True, text=True)
    return target


def _env(target: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"  # tiny tensors: one thread avoids oversubscribing a shared machine
    for var in ("ATTNPLUG_PLUGINS", "ATTNPLUG_DISABLE_PLUGINS", "ATTNPLUG_BACKEND"):
        env.pop(var, None)
    return env


def _attnplug(target: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnplug", *args], cwd=cwd, env=_env(target),
                          capture_output=True, text=True, timeout=300)


def test_backends_lists_it_with_its_distribution(installed, tmp_path):
    res = _attnplug(installed, "backends", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    (row,) = [r for r in data["backends"] if r["name"] == "sdpa_example"]
    assert (row["distribution"], row["version"], row["builtin"]) == ("attnplug-sdpa-example", "0.1.0", False)
    assert row["entry_point"] == "sdpa_example = attnplug_sdpa_example.plugin"
    assert row["available"] and row["features"] == {"sliding_window": True, "logits_soft_cap": False,
                                                   "mqa_gqa": True, "sinks": False, "alibi": False,
                                                   "alibi_sqrt": False, "non_causal": False, "lse_return": False,
                                                   "batch_invariant": False}
    assert data["faults"] == []
    table = _attnplug(installed, "backends", cwd=tmp_path)
    assert "sdpa_example" in table.stdout and "attnplug-sdpa-example" in table.stdout


def test_config_file_selects_it(installed, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(installed))
    registry = load_registry(env={})
    assert registry.entry("sdpa_example").source.describe() == "attnplug-sdpa-example 0.1.0"
    (tmp_path / "attnplug.toml").write_text('[backend]\nfull_attention = "sdpa_example"\n')
    cfg = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=64)
    res = select_backend(cfg, "full_attention", env={}, cwd=tmp_path, registry=registry)
    assert (res.name, res.source) == ("sdpa_example", "config")
    assert res.backend_cls.__module__ == "attnplug_sdpa_example.backend"
    explained = _attnplug(installed, "backends", "--explain", "--model", "preset", "--device", "cpu", "--json",
                          cwd=tmp_path)
    assert explained.returncode == 0, explained.stderr
    (group,) = json.loads(explained.stdout)["groups"]
    assert (group["chosen"], group["source"]) == ("sdpa_example", "config")


def test_attnplug_check_passes_on_it(installed, tmp_path):
    res = _attnplug(installed, "check", "sdpa_example", "-v", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "passed" in res.stdout
    assert "logits_soft_cap" in res.stdout  # its soft-cap cases are skipped with the declared reason
