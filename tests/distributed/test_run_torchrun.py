"""``attnplug run --tensor-parallel-size 2`` / ``--pipeline-parallel-size 2`` under torchrun (2
real processes, gloo; both: 4, slow) gives the same ``outputs_digest`` as one process (tiny-llama,
an attnplug_hybrid model of sliding-window, full-attention and Mamba2 layers, a Qwen3-MoE
model: experts split on their intermediate dimension, and, slow, a Qwen3-Next model: Gated
DeltaNet heads split), and reports
the broadcast and the collectives; the parallel flags refuse a launch they do not fit in one
line (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attnplug.runner.commands.run import main as run_main
from attnplug.runner.models import presets

HYBRID6 = "<hybrid6>"
QWEN3_MOE = "<qwen3_moe>"
QWEN3_MOE_CONFIG = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256,
                    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
                    "initializer_range": 0.1, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "norm_topk_prob": True, "mlp_only_layers": [0]}
"""A dense first layer, then experts sharded on their intermediate dimension, q/k norms per rank head."""
QWEN3_NEXT = "<qwen3_next>"
QWEN3_NEXT_CONFIG = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 256,
                     "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                     "linear_key_head_dim": 8, "linear_value_head_dim": 8, "full_attention_interval": 2,
                     "max_position_embeddings": 512, "initializer_range": 0.1, "num_experts": 4,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
                     "norm_topk_prob": True}
"""Gated DeltaNet layers (heads, conv channels, state split) beside gated attention, MoE + gated shared expert."""
CONFIGS = {QWEN3_MOE: ("qwen3_moe.json", QWEN3_MOE_CONFIG), QWEN3_NEXT: ("qwen3_next.json", QWEN3_NEXT_CONFIG)}

ARGS = ["--model", "tiny-llama", "--num-requests", "4", "--max-model-len", "256", "--max-num-batched-tokens", "64",
        "--invariance-requests", "1", "--json"]


@pytest.mark.parametrize("tp, pp, broadcast, extra", [
    (2, 1, "tensor", []), (1, 2, "fixed", []),
    pytest.param(2, 2, "fixed", [], marks=pytest.mark.slow),
    pytest.param(2, 1, "object", ["--async-scheduling"], marks=pytest.mark.slow),
    pytest.param(1, 2, "fixed", ["--async-scheduling"], marks=pytest.mark.slow),
    pytest.param(2, 1, "fixed", ["--model", "tiny-hybrid"], marks=pytest.mark.slow),  # sliding + full + Mamba2
    # each stage: a sliding-window, a full-attention and a Mamba2 layer
    (1, 2, "fixed", ["--model", HYBRID6]),
    pytest.param(2, 2, "fixed", ["--model", HYBRID6], marks=pytest.mark.slow),
    (2, 1, "fixed", ["--model", QWEN3_MOE]),
    pytest.param(1, 2, "fixed", ["--model", "tiny-qwen3-moe"], marks=pytest.mark.slow),
    pytest.param(2, 1, "fixed", ["--model", QWEN3_NEXT], marks=pytest.mark.slow),
], ids=["tp2", "pp2", "tp2xpp2", "tp2-async", "pp2-async", "tp2-hybrid", "pp2-hybrid6", "tp2xpp2-hybrid6",
        "tp2-qwen3_moe", "pp2-qwen3_moe", "tp2-qwen3_next"])
def test_torchrun_digest_equals_one_process(capsys, tmp_path, tp, pp, broadcast, extra):
    if HYBRID6 in extra:  # tiny-hybrid over 6 layers, so that both stages form the same cache groups
        cfg = {**presets.preset_config("tiny-hybrid"), "num_hidden_layers": 6, "attn_layer_indices": [0, 2, 3, 5],
               "sliding_attn_layer_indices": [0, 3]}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        extra = [str(tmp_path / "config.json") if x == HYBRID6 else x for x in extra]
    for key, (file, cfg) in CONFIGS.items():
        if key in extra:
            (tmp_path / file).write_text(json.dumps(cfg))
            extra = [str(tmp_path / file) if x == key else x for x in extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ATTNPLUG_VALIDATE": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp * pp), "-m",
                           "attnplug", "run", *ARGS, *extra, "--tensor-parallel-size", str(tp), "--pipeline-parallel-size",
                           str(pp), "--dist-broadcast", broadcast], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2 = json.loads(proc.stdout)  # rank 0 alone prints
    assert run_main(ARGS + extra) == 0
    tp1 = json.loads(capsys.readouterr().out)
    assert tp2["outputs_digest"] == tp1["outputs_digest"] and tp2["generated_tokens"] == tp1["generated_tokens"] > 0
    assert (tp2["tensor_parallel_size"], tp2["pipeline_parallel_size"]) == (tp, pp)
    assert (tp1["tensor_parallel_size"], tp1["pipeline_parallel_size"]) == (1, 1)
    stages = tp2["median_us_per_step"]
    assert stages["broadcast"] > 0 and stages["collectives"] > 0 and "broadcast" not in tp1["median_us_per_step"]
    assert tp2["batch_invariance"] == {"identical": 1, "checked": 1}


def test_parallel_sizes_must_fit_the_launch(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run_main([*ARGS, "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "WORLD_SIZE is 1" in err and "torchrun --nproc-per-node 2" in err
    with pytest.raises(SystemExit) as exit_:
        run_main([*ARGS, "--tensor-parallel-size", "0"])
    assert exit_.value.code == 2 and "--tensor-parallel-size: 0 is out of range" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_broadcast_reports_the_three_methods():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "attnplug",
                           "bench", "broadcast", "--num-requests", "4", "--repeat", "1", "--json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["steps"] > 0 and res["world_size"] == 2 and res["update_plus_prepare_us"] > 0
    assert all(res[f"{m}_us"] > 0 for m in ("object", "fixed", "tensor"))
    assert res["tensor_bytes"] > 0 and res["object_bytes"] > 0
