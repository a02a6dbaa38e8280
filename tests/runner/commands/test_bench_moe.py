"""``attnplug bench moe``: the vectorised MoE block and the per-token loop timed side by side on
1..N tokens with equal results, torch threads recorded (table and --json); a config's MoE
(DeepSeek-V3's grouped sigmoid router with shared experts) runs too."""

from __future__ import annotations

import json

from attnplug.runner.commands.bench.moe import main as bench_moe

SMALL = ["--hidden-size", "32", "--num-experts", "8", "--num-experts-per-tok", "2", "--moe-intermediate-size", "16",
         "--repeat", "2", "--naive-repeat", "1"]


def test_bench_moe_json_rows(capsys):
    assert bench_moe(["--tokens", "1,4,32", *SMALL, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["torch_threads"] == 1 and res["wrong_results"] == []
    assert [r["tokens"] for r in res["rows"]] == [1, 4, 32]
    for r in res["rows"]:
        assert r["vectorised_tokens_per_s"] > 0 and r["naive_tokens_per_s"] > 0 and r["speedup"] > 0
        assert 2 <= r["experts_hit"] <= 8 and r["max_abs_diff"] <= 1e-4


def test_bench_moe_table_of_a_deepseek_v3_config(tmp_path, capsys):
    cfg = {"model_type": "deepseek_v3", "hidden_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 16, "n_shared_experts": 1, "n_group": 4, "topk_group": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert bench_moe(["--tokens", "3", "--hf-config", str(tmp_path / "config.json"), *SMALL[-4:]]) == 0
    out = capsys.readouterr().out
    assert "router sigmoid/noaux_tc" in out and "1 shared" in out and "torch threads: 1" in out
    assert out.count("\n| 3 |") == 1
