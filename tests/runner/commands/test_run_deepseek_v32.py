"""`attnplug run --model <deepseek_v32 config>`: the indexer cache group beside the latent
group in the cache table (bytes per token and layer); selection gives the sparse layers a
sparse consumer and never a dense MLA backend (nor a sparse one to a dense layer)."""

from __future__ import annotations

import json

from attnplug.backends.mla.torch_native.backend import TorchNativeMLABackend
from attnplug.backends.sparse.torch_native.backend import TorchNativeIndexerBackend, TorchNativeSparseMLABackend
from attnplug.core.mla import MLALayerConfig
from attnplug.core.sparse import IndexerLayerConfig, SparseMLALayerConfig
from attnplug.runner.commands.run import main as run_main

V32 = {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], "vocab_size": 128, "hidden_size": 64,
       "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
       "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
       "n_shared_experts": 1, "first_k_dense_replace": 1, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 4}


def test_run_reports_the_indexer_group_and_its_bytes_per_token(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(V32))
    assert run_main(["--model", str(path), "--num-requests", "2", "--invariance-requests", "0", "--json"]) == 0
    groups = {g["kind"]: g for g in json.loads(capsys.readouterr().out)["cache_groups"]}
    assert set(groups) == {"mla", "indexer"}
    assert groups["mla"]["backend"] == "torch_native_sparse_mla" and groups["mla"]["layers"] == 2
    assert groups["mla"]["bytes_per_token_per_layer"] == (32 + 16) * 4
    assert groups["indexer"]["backend"] == "torch_native_indexer" and groups["indexer"]["layers"] == 2
    assert groups["indexer"]["bytes_per_token_per_layer"] == 32 * 4


def test_a_dense_mla_backend_named_for_the_sparse_layers_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(V32))
    assert run_main(["--model", str(path), "--backend", "mla=torch_native_mla", "--num-requests", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "torch_native_mla" in err and "index_topk" in err and "sparse MLA backend" in err, err


def test_dense_and_sparse_mla_backends_refuse_each_others_layers():
    dims = dict(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    sparse, dense = SparseMLALayerConfig(**dims, index_topk=8), MLALayerConfig(**dims)
    assert any("index_topk" in r for r in TorchNativeMLABackend.validate_configuration(sparse))
    assert any("sparse MLA layers only" in r for r in TorchNativeSparseMLABackend.validate_configuration(dense))
    assert TorchNativeSparseMLABackend.validate_configuration(sparse) == []
    assert TorchNativeIndexerBackend.validate_configuration(IndexerLayerConfig(4, 32, 8)) == []
    assert any("indexer layers only" in r for r in TorchNativeIndexerBackend.validate_configuration(dense))
    assert any("index_topk must be a positive int" in r
               for r in TorchNativeIndexerBackend.validate_configuration(IndexerLayerConfig(4, 32, 0)))
