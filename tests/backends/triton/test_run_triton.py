"""``attnplug run --backend triton`` on the CPU (Triton interpreter): the engine runs the
bundled trace and samples the same greedy tokens as ``torch_native``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attnplug.runner.commands import run as run_cmd
from attnplug.runner.commands.assemble import build_engine

ARGS = ["--model", "tiny-hybrid", "--num-requests", "4", "--invariance-requests", "0"]  # a random preset: fast


def _greedy_tokens(backend: str) -> dict[str, list[int]]:
    """What ``attnplug run --backend BACKEND --num-requests 4`` samples (the CLI's own parser
    and engine assembly, without its progress bar and table)."""
    args = run_cmd._parser().parse_args(["--backend", backend, *ARGS])
    setup = build_engine(args)
    for rid, prompt in setup.prompts.items():
        setup.engine.add_request(rid, prompt, setup.sampling_params[rid])
    attention = {b.get_name() for b in setup.backends if b.kv_cache_kind == "attention"}
    assert attention == {backend}, "--backend NAME serves every attention cache group"
    results = setup.engine.run()
    return {rid: r.output_token_ids for rid, r in results.items()}


def test_run_gives_the_same_greedy_tokens_as_torch_native():
    triton_tokens = _greedy_tokens("triton")
    reference = _greedy_tokens("torch_native")
    assert triton_tokens.keys() == reference.keys() and len(triton_tokens) == 4
    assert sum(len(t) for t in triton_tokens.values()) > 4
    assert triton_tokens == reference


@pytest.mark.slow
def test_cli_run_with_batch_invariance_check(tmp_path):
    """The command exactly as documented, in a fresh process (its own TRITON_INTERPRET=1):
    it exits 0 only when the re-run-alone requests give identical tokens."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "attnplug", "run", "--model", "tiny-hybrid", "--backend", "triton", "--num-requests", "4",
                          "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    attention = [g for g in summary["cache_groups"] if g["kind"] != "mamba"]
    assert summary["requests"] == 4 and attention and all(g["backend"] == "triton" for g in attention)
    assert summary["batch_invariance"] == {"identical": 4, "checked": 4}


def test_cli_without_the_interpreter_explains_itself(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run([sys.executable, "-m", "attnplug", "run", "--model", "tiny-hybrid", "--backend", "triton", "--num-requests", "1"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "backend 'triton' cannot serve" in res.stderr and "TRITON_INTERPRET=1" in res.stderr, res.stderr
