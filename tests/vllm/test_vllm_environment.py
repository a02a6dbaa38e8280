"""The vLLM environment ``make test`` built for this minor holds vLLM's own pins: ``pip
check`` reports exactly the complaints its ``pip-check-expected.txt`` documents (none of
them a version conflict the environment could avoid), and nothing of the main
environment's (transformers 5.24 is outside vLLM's ``<5.20`` / ``<5.21``)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_pip_check_reports_only_the_documented_complaints(vllm_installed):
    from attnplug.plugins.vllm.versions import adapter_name

    expected = REPO / "plugins" / "vllm" / adapter_name(vllm_installed) / "pip-check-expected.txt"
    want = {ln.strip() for ln in expected.read_text(encoding="utf-8").splitlines() if ln.strip()}
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    got = {ln.strip() for ln in proc.stdout.splitlines() if ln.strip() and "No broken requirements" not in ln}
    assert got == want, f"unexpected: {sorted(got - want)}; no longer reported: {sorted(want - got)}"
