"""A config the models cannot run is one line naming the field, exit status 2, from `attnplug
run`, `attnplug parity` and `attnplug bench moe` — an unknown model_type, a router kind not
implemented, inconsistent expert counts, dense layers out of range — never a traceback and
never a silent fallback to a dense MLP."""

from __future__ import annotations

import json

import pytest

from attnplug.runner.commands.bench.moe import main as bench_moe
from attnplug.runner.commands.parity import main as parity_main
from attnplug.runner.commands.run import main as run_main
from attnplug.runner.models import ModelConfigError
from attnplug.runner.models.moe_config import MoEConfig, parse_moe

QWEN3_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64,
             "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 16, "n_shared_experts": 1, "n_group": 4, "topk_group": 2}
BAD = {  # name: (config, what the line must name, commands that read it)
    "unknown-model_type": ({**QWEN3_MOE, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"]},
                           "model_type='mixtral'", ("run", "parity", "bench")),
    "k-above-experts": ({**QWEN3_MOE, "num_experts_per_tok": 5}, "num_experts_per_tok 5 exceeds the 4 experts",
                        ("run", "parity", "bench")),
    "mlp_only_layers": ({**QWEN3_MOE, "mlp_only_layers": [0, 7]}, "mlp_only_layers [7]", ("run", "parity")),
    "decoder_sparse_step": ({**QWEN3_MOE, "decoder_sparse_step": 0}, "decoder_sparse_step", ("run", "parity")),
    "moe-width-missing": ({**QWEN3_MOE, "moe_intermediate_size": None}, "moe_intermediate_size", ("run", "bench")),
    "router-topk_method": ({**DEEPSEEK_V3, "topk_method": "sinkhorn"}, "topk_method 'sinkhorn' is not implemented",
                           ("bench",)),
    "router-scoring_func": ({**DEEPSEEK_V3, "scoring_func": "softmax"}, "noaux_tc' needs scoring_func 'sigmoid'",
                            ("bench",)),
    "n_group": ({**DEEPSEEK_V3, "n_group": 3}, "n_group 3 does not divide the 8 experts", ("bench",)),
}
COMMANDS = {"run": lambda p: run_main(["--model", p, "--num-requests", "1"]),
            "parity": lambda p: parity_main(["--hf-config", p]),
            "bench": lambda p: bench_moe(["--hf-config", p, "--tokens", "1"])}


@pytest.mark.parametrize("name, command", [(n, c) for n, (_, _, cs) in BAD.items() for c in cs])
def test_bad_model_config_is_one_line_exit_2(tmp_path, capsys, name, command):
    cfg, names, _ = BAD[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    if command == "parity":
        pytest.importorskip("transformers")
    assert COMMANDS[command](str(path)) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and names in err and "Traceback" not in err, err
    assert captured.out == ""


def test_moe_config_names_each_inconsistency():
    base = dict(hidden_size=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4)
    for change, match in [({"topk_group": 5, "n_group": 4, "topk_method": "group_limited_greedy"}, "topk_group 5"),
                          ({"num_experts_per_tok": 6, "n_group": 4, "topk_group": 1, "topk_method": "noaux_tc",
                            "scoring_func": "sigmoid"}, "exceeds the 2 experts of topk_group"),
                          ({"expert_kind": "geglu"}, "expert kind 'geglu'"), ({"num_experts": 0}, "num_experts"),
                          ({"num_shared_experts": -1}, "n_shared_experts")]:
        with pytest.raises(ModelConfigError, match=match):
            MoEConfig(**{**base, **change})
    with pytest.raises(ModelConfigError, match="norm_topk_prob true is not supported for deepseek_v2"):
        parse_moe({**DEEPSEEK_V3, "norm_topk_prob": True, "topk_method": "greedy", "scoring_func": None},
                  "deepseek_v2")
    with pytest.raises(ModelConfigError, match="hidden_act 'gelu'"):
        parse_moe({**DEEPSEEK_V3, "hidden_act": "gelu"}, "deepseek_v3")
