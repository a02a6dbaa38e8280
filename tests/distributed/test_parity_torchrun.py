"""``attnplug parity --tensor-parallel-size 2`` under torchrun (2 real processes, gloo; slow):
our model sharded over the ranks gives HF's greedy tokens, for a tiny Qwen3-Next (GDN heads,
conv channels and state split; gated attention; MoE + gated shared expert) under forced
preemption, with the cross-rank metadata check every step. Refusals (no processes): a model
that does not split, sizes that do not fit the launch, real weights: one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from attnplug.runner.commands.parity import main as parity_main  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "runner" / "models"))
from parity_runs import QWEN2_VL  # noqa: E402

QWEN3_NEXT = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 128,
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 8, "linear_value_head_dim": 8, "full_attention_interval": 2,
              "max_position_embeddings": 256, "initializer_range": 0.1, "rms_norm_eps": 1e-5,
              "partial_rotary_factor": 0.5, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
              "shared_expert_intermediate_size": 16, "norm_topk_prob": True}


@pytest.mark.slow
def test_parity_at_tp2_under_torchrun_equals_hf(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ATTNPLUG_VALIDATE": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                           "attnplug", "parity", "--hf-config", str(tmp_path / "config.json"), "--tensor-parallel-size",
                           "2", "--force-preemption", "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    res = json.loads(proc.stdout)  # rank 0 alone prints
    assert res["ok"] and res["num_identical"] == res["num_requests"] == 6 and res["preemptions"] > 0, res


def test_parity_parallel_refusals_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**QWEN3_NEXT, "linear_num_key_heads": 1}))
    assert parity_main(["--hf-config", str(cfg), "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "linear_num_key_heads 1 is not a multiple of 2" in err, err
    cfg.write_text(json.dumps(QWEN3_NEXT))
    assert parity_main(["--hf-config", str(cfg), "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "WORLD_SIZE is 1" in err, err
    assert "-m attnplug parity" in err, err  # the launch line to copy names the command that failed
    cfg.write_text(json.dumps(QWEN2_VL))  # was a traceback on every rank (HF's AutoModelForCausalLM)
    assert parity_main(["--hf-config", str(cfg), "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "qwen2_vl (images) runs in one process only" in err, err
    assert parity_main(["--model", "smollm2", "--tensor-parallel-size", "2"]) == 2
    assert "real weights (--model) run in one process" in capsys.readouterr().err
