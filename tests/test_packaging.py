"""The repo root is the package `attnplug`: every package dir is listed, the wheel holds only it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_SHIPPED = {"tests", "docs", ".venv", "build", "dist", ".git", ".ci"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_dirs() -> set[str]:
    found = set()
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and (rel.parts[0] in NOT_SHIPPED or rel.parts[0].startswith(".") or "egg-info" in rel.parts[0]):
            continue
        found.add(".".join(("attnplug",) + rel.parts))
    return found


def test_top_level_layout():
    for name in ("pyproject.toml", "core", "backends", "cache_groups", "runner", "plugins", "tests",
                 "docs", "README.md", "Makefile", ".ci", "__init__.py", "__main__.py"):
        assert (ROOT / name).exists(), f"top-level {name} is missing"


def test_every_package_dir_is_listed():
    cfg = _pyproject()["tool"]["setuptools"]
    assert cfg["package-dir"] == {"attnplug": "."}
    listed = set(cfg["packages"])
    missing = _package_dirs() - listed
    assert not missing, f"package directories missing from pyproject packages: {sorted(missing)}"
    stale = {p for p in listed if not (ROOT.joinpath(*p.split(".")[1:]) / "__init__.py").exists()}
    assert not stale, f"pyproject lists packages that do not exist: {sorted(stale)}"


def test_console_script_and_extras():
    proj = _pyproject()["project"]
    assert proj["scripts"]["attnplug"] == "attnplug.runner.commands.cli:main"
    deps = " ".join(proj["dependencies"])
    for dep in ("torch", "numpy", "pluggy"):
        assert dep in deps
    extras = proj["optional-dependencies"]
    assert "triton" in " ".join(extras["triton"])
    assert "flash-attn" in " ".join(extras["flash-attn"])
    assert "flashinfer-python" in " ".join(extras["flashinfer"])
    assert {"pytest", "hypothesis"} <= {d.split(">")[0].split("=")[0] for d in extras["test"]}


def test_wheel_contains_only_the_package(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".venv-vllm", ".git", "build", "*.egg-info",
                                                              "__pycache__", ".hypothesis", "*.so", "_native.c"))
    out = tmp_path / "wheel"
    # What is checked is the wheel's file list, not its machine code: CFLAGS=-O0 -g0 (appended after
    # Python's own flags) makes gcc's pass over the 3 MB _native.c a fraction of the -O3 build's
    # (the extensions with their own -O3 in pyproject keep it): 98 s -> 73 s alone on a busy two-core machine.
    env = {**os.environ, "CFLAGS": "-O0 -g0"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, capture_output=True, env=env)
    (whl,) = out.glob("attnplug-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    outside = [n for n in names if not (n.startswith("attnplug/") or ".dist-info/" in n)]
    assert not outside, f"wheel has files outside the package: {outside[:10]}"
    assert not [n for n in names if n.startswith(("attnplug/tests/", "attnplug/docs/"))]
    assert "attnplug/core/metadata.py" in names
    assert "attnplug/runner/data/azure_llm_2023_conv.csv" in names
    assert "attnplug/runner/data/README.md" in names
    # the compiled fast paths are built from runner/step/fast/_native.pyx (Cython) into the wheel
    assert [n for n in names if n.startswith("attnplug/runner/step/fast/_native.") and n.endswith(".so")], names


def test_python_dash_m_runs_the_cli():
    res = subprocess.run([sys.executable, "-m", "attnplug", "--help"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "explain" in res.stdout and "run" in res.stdout


def test_one_python_floor_everywhere():
    """pyproject's requires-python, the README's quickstart and the Makefile's guard agree
    (3.11: ``plugins/config.py`` imports ``tomllib`` unconditionally)."""
    import re

    root = Path(__file__).resolve().parents[1]
    floor = tomllib.loads((root / "pyproject.toml").read_text())["project"]["requires-python"]
    assert floor == ">=3.11"
    assert "Python 3.11+" in (root / "README.md").read_text()
    assert re.search(r"sys\.version_info >= \(3, 11\)", (root / "Makefile").read_text())
    assert "import tomllib" in (root / "plugins" / "config.py").read_text()
