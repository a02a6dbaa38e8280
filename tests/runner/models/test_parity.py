"""`attnplug parity`: our engine (continuous batching, chunked prefill, preemption) vs HF."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from attnplug.core.errors import AttnplugError
from attnplug.runner.commands.parity import main as parity_main
from attnplug.runner.commands.parity import run_parity

BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "initializer_range": 0.1}

CONFIGS = {
    "llama-gqa": {**BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                  "num_key_value_heads": 2, "rope_theta": 10000.0},
    "qwen2-bias": {**BASE, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                   "num_key_value_heads": 2, "rope_theta": 1000000.0, "use_sliding_window": False,
                   "tie_word_embeddings": True},
    "mistral-nowindow": {**BASE, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                         "num_key_value_heads": 1, "sliding_window": None, "head_dim": 16},
}


@pytest.mark.parametrize("force_preemption", [False, True], ids=["chunked", "chunked+preempt"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parity_with_hf(name, force_preemption):
    res = run_parity(CONFIGS[name], num_requests=5, seed=1, force_preemption=force_preemption,
                     max_num_batched_tokens=16, max_tokens=5, block_size=4)
    assert res.ok, res.line()
    assert res.num_identical == res.num_requests == 5
    assert res.max_abs_dlogit <= res.tolerance
    if force_preemption:
        assert res.preemptions > 0, "forced preemption did not preempt anything"


def test_parity_cli_ok_and_unsupported(tmp_path, capsys):
    good = tmp_path / "config.json"
    good.write_text(json.dumps(CONFIGS["llama-gqa"]))
    assert parity_main(["--hf-config", str(good), "--num-requests", "3", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("parity: OK tokens 3/3 identical, max |dlogit| = ")
    assert parity_main(["--hf-config", str(good), "--num-requests", "2", "--max-tokens", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] is True and res["num_identical"] == res["num_requests"] == 2, res
    assert res["max_abs_dlogit"] <= res["tolerance"] and res["first_divergence"] is None

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**BASE, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert parity_main(["--hf-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "gpt2" in err and "llama" in err and "qwen2" in err and "mistral" in err


def test_parity_rejects_unknown_dtype():
    with pytest.raises(AttnplugError, match="dtype"):
        run_parity(CONFIGS["llama-gqa"], dtype="float8")
