"""``attnplug parity``'s integer flags out of range: one line on stderr, exit 2, and no
model is built (the review found ``--num-requests -1`` / ``--seed -1`` ending in a numpy
traceback, exit 1, and ``--num-requests 0`` blamed on ``num_blocks``)."""

from __future__ import annotations

import json

import pytest

from attnplug.runner.commands.parity import main as parity_main

CFG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 32,
       "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
       "max_position_embeddings": 256}


@pytest.mark.parametrize("flag,value", [("--num-requests", "-1"), ("--num-requests", "0"), ("--seed", "-1"),
                                        ("--max-tokens", "0"), ("--block-size", "0"),
                                        ("--max-num-batched-tokens", "0"), ("--seed", "1e3")])
def test_out_of_range_is_one_line_exit_2(tmp_path, capsys, flag, value):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CFG))
    with pytest.raises(SystemExit) as e:
        parity_main(["--hf-config", str(cfg), flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and flag in err and "Traceback" not in err, err
