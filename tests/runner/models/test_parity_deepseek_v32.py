"""`attnplug parity` on DeepSeek-V3.2 (sparse attention: the indexer cache group, the
torch_native selector and sparse MLA consumer): greedy tokens identical to HF transformers,
fp32, for prompts longer than index_topk (so the selection matters), under chunked prefill,
forced preemption and prefix caching; the indexer group is in the run's cache table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from attnplug.runner.commands.parity import run_parity  # noqa: E402
from attnplug.runner.models import build_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from parity_runs import assert_parity, options  # noqa: E402

V32 = {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], "vocab_size": 128,
       "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48,
       "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8,
       "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
       "routed_scaling_factor": 2.5, "norm_topk_prob": True, "max_position_embeddings": 256, "rope_theta": 10000.0,
       "initializer_range": 0.1, "index_n_heads": 16, "index_head_dim": 32, "index_topk": 6}
OPTIONS = options("chunked", "preempt", "prefix")


@pytest.mark.parametrize("option", list(OPTIONS))
def test_deepseek_v32_parity_with_hf(option):
    res = run_parity(V32, num_requests=3, seed=1, max_num_batched_tokens=16, max_tokens=4, block_size=4,
                     prompt_len_range=(10, 24), **OPTIONS[option])
    assert_parity(res, option, 3, check_dlogit=False)


def test_deepseek_v32_has_an_indexer_group_beside_the_latent_group():
    model = build_model(V32)
    specs = model.kv_cache_specs(block_size=16)
    assert list(specs) == ["model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer",
                           "model.layers.1.self_attn.attn", "model.layers.1.self_attn.indexer"]
    latent, index = specs["model.layers.0.self_attn.attn"], specs["model.layers.0.self_attn.indexer"]
    assert (latent.kind, index.kind) == ("mla", "indexer")
    assert index.head_size == 32 and index.bytes_per_token == 32 * 4 and index.page_size_bytes == 16 * 32 * 4
    attn = model.model.layers[0].self_attn
    assert type(attn.impl).__name__ == "TorchNativeSparseMLAImpl"
    assert type(attn.indexer.impl).__name__ == "TorchNativeSelectorImpl"


@pytest.mark.parametrize("field, value, words", [
    ("index_topk", 0, "index_topk must be a positive int, got 0"),
    ("index_head_dim", 8, "index_head_dim 8 < qk_rope_head_dim 16"),
    ("index_n_heads", None, "deepseek_v32 config lacks ['index_n_heads']"),
    ("q_lora_rank", None, "q_lora_rank must be set"),
])
def test_bad_indexer_fields_are_one_line_naming_the_field(tmp_path, capsys, field, value, words):
    from attnplug.runner.commands.parity import main as parity_main

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**V32, field: value}))
    assert parity_main(["--hf-config", str(path), "--num-requests", "2", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err, err
