"""`attnplug parity` on Qwen3 (per-head q/k norms; tied and untied; YaRN RoPE) and Qwen3-MoE
(mixture-of-experts MLPs with a dense first layer through ``mlp_only_layers``, or every other
layer dense through ``decoder_sparse_step``): greedy tokens identical to HF transformers, fp32,
under chunked prefill, forced preemption, prefix caching, n-gram speculative decoding and
async scheduling; and the CLI on a Qwen3-MoE config.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from attnplug.runner.commands.parity import main as parity_main  # noqa: E402
from attnplug.runner.commands.parity import run_parity  # noqa: E402
from attnplug.runner.models import Qwen3ModelConfig, build_model, resolve_model_config  # noqa: E402
from attnplug.runner.models.moe import MoEBlock  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from parity_runs import PARITY_OPTIONS as OPTIONS  # noqa: E402
from parity_runs import assert_parity  # noqa: E402

BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "initializer_range": 0.1}
QWEN3 = {**BASE, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "rope_theta": 1_000_000.0}
QWEN3_MOE = {**BASE, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [0]}
CONFIGS = {
    "qwen3": QWEN3,
    "qwen3-tied": {**QWEN3, "tie_word_embeddings": True, "attention_bias": True},
    "qwen3-yarn": {**QWEN3, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                "original_max_position_embeddings": 32}},
    "qwen3_moe-dense-first": QWEN3_MOE,
    "qwen3_moe-sparse-step": {**QWEN3_MOE, "num_hidden_layers": 3, "mlp_only_layers": [], "decoder_sparse_step": 2,
                              "norm_topk_prob": False, "num_experts_per_tok": 3},
}
RUNS = [("qwen3", o) for o in OPTIONS] + [("qwen3_moe-dense-first", o) for o in OPTIONS] + [
    ("qwen3-tied", "preempt"), ("qwen3-yarn", "chunked"), ("qwen3_moe-sparse-step", "preempt"),
    ("qwen3_moe-sparse-step", "prefix")]


@pytest.mark.parametrize("name, option", RUNS, ids=[f"{n}-{o}" for n, o in RUNS])
def test_qwen3_parity_with_hf(name, option):
    res = run_parity(CONFIGS[name], num_requests=5, seed=1, max_num_batched_tokens=16, max_tokens=5, block_size=4,
                     **OPTIONS[option])
    assert_parity(res, option, 5)


def test_qwen3_moe_layers_and_weights():
    cfg = resolve_model_config(CONFIGS["qwen3_moe-sparse-step"])
    assert isinstance(cfg, Qwen3ModelConfig) and cfg.sparse_layers == (False, True, False)
    model = build_model(CONFIGS["qwen3_moe-sparse-step"])
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["SwiGLUMLP", "MoEBlock", "SwiGLUMLP"]
    moe = model.model.layers[1].mlp
    assert isinstance(moe, MoEBlock) and tuple(moe.experts.gate_up_proj.shape) == (8, 64, 64)
    assert model.model.layers[0].self_attn.q_norm.weight.eq(1).all()  # norms start at 1, weights random
    assert moe.experts.down_proj.std() > 0.05


def test_parity_cli_on_a_qwen3_moe_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_MOE))
    assert parity_main(["--hf-config", str(path), "--num-requests", "3", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("parity: OK tokens 3/3 identical")
