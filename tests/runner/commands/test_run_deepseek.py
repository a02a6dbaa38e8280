"""`attnplug run --model <deepseek config>`: the MLA cache group in the summary and the cache
table (latent row bytes per token and layer); selection never gives an MLA group to an
attention backend."""

from __future__ import annotations

import json

import pytest

from attnplug.cache_groups.specs import MLAAttentionSpec
from attnplug.core.mla import MLALayerConfig
from attnplug.plugins.selection import select_backend
from attnplug.runner.commands.assemble import kv_bytes_per_token
from attnplug.runner.commands.run import main as run_main

V3 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 128, "hidden_size": 64,
      "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
      "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
      "n_shared_experts": 1, "first_k_dense_replace": 1}


def test_run_reports_the_latent_group_and_its_bytes_per_token(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(V3))
    assert run_main(["--model", str(path), "--num-requests", "4", "--invariance-requests", "0", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    [group] = summary["cache_groups"]
    assert group["kind"] == "mla" and group["backend"] == "torch_native_mla" and group["layers"] == 2
    assert group["bytes_per_token_per_layer"] == (32 + 16) * 4


def test_deepseek_real_dims_cost_576_values_per_token_and_layer():
    spec = MLAAttentionSpec(block_size=64, kv_lora_rank=512, qk_rope_head_dim=64, dtype=__import__("torch").bfloat16)
    assert kv_bytes_per_token(spec) == 576 * 2 and spec.page_size_bytes == 64 * 576 * 2


def test_selection_never_gives_an_mla_group_to_an_attention_backend():
    cfg = MLALayerConfig(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    result = select_backend(cfg, "mla", env={})
    assert result.name == "torch_native_mla"
    rejected = {r.backend: r.reasons for r in result.rejections}
    assert rejected["torch_native"] == ("serves 'attention' caches; mla groups need a backend with kv_cache_kind "
                                        "'mla'",)


def test_an_attention_backend_chosen_for_mla_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(V3))
    assert run_main(["--model", str(path), "--num-requests", "2", "--backend", "mla=triton"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "backend 'triton' serves attention caches, not mla cache groups" in err, err


@pytest.mark.parametrize("field, value", [("v_head_dim", 0), ("qk_rope_head_dim", 7)])
def test_run_refuses_inconsistent_mla_dims_naming_the_field(tmp_path, capsys, field, value):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**V3, field: value}))
    assert run_main(["--model", str(path), "--num-requests", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and field in err, err
