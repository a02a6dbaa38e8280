"""`attnplug parity` on DeepSeek-V3 (q_lora_rank, YaRN with mscale_all_dim, interleaved RoPE,
sigmoid noaux_tc routing with groups, a shared expert, a dense first layer) and DeepSeek-V2
(q_proj, softmax greedy routing, two shared experts) over the MLA backends: greedy tokens
identical to HF transformers, fp32, under chunked prefill (also with the cached context
gathered through a tiny workspace), forced preemption, prefix caching, n-gram speculative decoding and async
scheduling; an inconsistent MLA config is one line naming the field, exit 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from attnplug.runner.commands.parity import main as parity_main  # noqa: E402
from attnplug.runner.commands.parity import run_parity  # noqa: E402
from attnplug.runner.models import build_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from parity_runs import PARITY_OPTIONS as OPTIONS  # noqa: E402
from parity_runs import assert_parity  # noqa: E402

BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "max_position_embeddings": 256,
        "rope_theta": 10000.0, "initializer_range": 0.1}
V3 = {**BASE, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "q_lora_rank": 48,
      "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
      "rope_interleave": True,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                       "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
V2 = {**BASE, "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "q_lora_rank": None,
      "n_shared_experts": 2, "topk_method": "greedy"}
CONFIGS = {"v3": V3, "v2": V2}
RUNS = [("v3", o) for o in OPTIONS] + [("v2", o) for o in ("chunked", "preempt", "ngram")]


@pytest.mark.parametrize("name, option", RUNS, ids=[f"{n}-{o}" for n, o in RUNS])
def test_deepseek_parity_with_hf(name, option):
    res = run_parity(CONFIGS[name], num_requests=4, seed=1, max_num_batched_tokens=16, max_tokens=5, block_size=4,
                     **OPTIONS[option])
    assert_parity(res, option, 4)


def test_deepseek_parity_with_context_chunked_through_a_tiny_workspace(monkeypatch):
    """The engine's builders get a workspace of max_num_reqs rows: every continuation's cached
    context is gathered and merged in many chunks, and the tokens still match HF."""
    from attnplug.backends.mla.common import builder

    chunked = []
    plan = builder.plan_context_chunks
    monkeypatch.setattr(builder, "default_workspace_tokens", lambda config, block_size: config.max_num_reqs)
    monkeypatch.setattr(builder, "plan_context_chunks", lambda ctx, ws: chunked.append(len(plan(ctx, ws))) or plan(ctx, ws))
    res = run_parity(V3, num_requests=4, seed=2, max_num_batched_tokens=8, max_tokens=4, block_size=4)
    assert res.ok, res.line()
    assert max(chunked) > 4, f"the context was never split into many chunks: {chunked}"


def test_deepseek_layers_are_mla_with_the_latent_cache_spec():
    model = build_model(V3)
    spec = model.kv_cache_specs(block_size=16)["model.layers.0.self_attn.attn"]
    assert spec.kind == "mla" and spec.head_size == 48 and spec.bytes_per_token == 48 * 4
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SwiGLUMLP", "MoEBlock"]
    assert type(model.model.layers[0].self_attn.impl).__name__ == "TorchNativeMLAImpl"


@pytest.mark.parametrize("field, value, words", [
    ("kv_lora_rank", 0, "kv_lora_rank must be a positive int, got 0"),
    ("qk_rope_head_dim", 15, "qk_rope_head_dim must be even"),
    ("q_lora_rank", -4, "q_lora_rank must be a positive int or null"),
])
def test_inconsistent_mla_dims_are_one_line_naming_the_field(tmp_path, capsys, field, value, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**V3, field: value}))
    assert parity_main(["--hf-config", str(path), "--num-requests", "2", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err, err
