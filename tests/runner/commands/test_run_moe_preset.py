"""``attnplug run --model tiny-qwen3-moe``: the mixture-of-experts preset runs through the engine,
its tokens batch-invariant (each request alone gives the tokens it got in the batch)."""

from __future__ import annotations

import json

from attnplug.runner.commands.run import main as run_main
from attnplug.runner.models import build_model, preset_config


def test_moe_preset_runs_batch_invariant(capsys):
    assert run_main(["--model", "tiny-qwen3-moe", "--num-requests", "4", "--invariance-requests", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["generated_tokens"] > 0 and res["batch_invariance"] == {"identical": 2, "checked": 2}
    model = build_model(preset_config("tiny-qwen3-moe"))
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SwiGLUMLP"] + ["MoEBlock"] * 3
