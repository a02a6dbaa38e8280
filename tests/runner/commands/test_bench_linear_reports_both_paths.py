"""``attnplug bench linear`` (runner/commands/bench/linear.py): a model's decode linears timed
through torch's oneDNN op and through oneDNN's C API directly, with equal outputs, the thread
count and the load; its errors in one line with exit status 2."""

from __future__ import annotations

import json

import pytest
import torch

from attnplug.runner.commands.bench import linear
from attnplug.runner.models import cpu_linear, onednn


@pytest.fixture(autouse=True)
def _direct_decided_again():
    yield
    cpu_linear.use_direct()


def test_decode_shapes_of_a_llama_config():
    cfg = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
           "vocab_size": 49152}
    assert linear.decode_shapes(cfg) == [("qkv_proj", 960, 576), ("o_proj", 576, 576), ("gate_up_proj", 3072, 576),
                                         ("down_proj", 576, 1536), ("lm_head", 49152, 576)]


@pytest.mark.skipif(onednn.matmul_module() is None, reason="no direct oneDNN path (no onednn-cpu-gomp wheel)")
def test_both_paths_timed_with_equal_outputs_and_the_thread_count(capsys):
    before = torch.get_num_threads()
    try:
        rc = linear.main(["--model", "tiny-llama", "--rows", "3", "--threads", "1", "--rounds", "2", "--iters", "2",
                          "--warmup", "0", "--json"])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["torch_threads"] == 1 and out["onednn"].startswith("3.") and len(out["load_start"]) == 3
    assert [c["linear"] for c in out["cases"]] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    for c in out["cases"]:
        assert c["rows"] == 3 and c["max_abs_diff"] == 0.0
        assert c["torch_op_us"] > 0 and c["direct_us"] > 0
        assert c["saved_us"] == pytest.approx(c["torch_op_us"] - c["direct_us"])
    assert cpu_linear._DIRECT[0] is onednn.matmul_module()  # the benchmark leaves the decision as it was


def test_bad_rows_and_a_missing_direct_path_exit_2(capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        linear.main(["--rows", "0"])
    assert e.value.code == 2 and "--rows: '0': each row count must be >= 1" in capsys.readouterr().err
    monkeypatch.setenv(onednn.ENV_SWITCH, "0")
    assert linear.main(["--model", "tiny-llama"]) == 2
    assert capsys.readouterr().err.strip() == ("attnplug bench linear: the direct oneDNN path is unavailable: "
                                               "ATTNPLUG_ONEDNN_DIRECT=0")


@pytest.mark.skipif(onednn.matmul_module() is None, reason="no direct oneDNN path (no onednn-cpu-gomp wheel)")
def test_the_engine_with_the_direct_path_on_and_off_makes_the_same_tokens(capsys):
    before = torch.get_num_threads()
    try:
        rc = linear.main(["--engine", "--model", "tiny-llama", "--threads", "1", "--rounds", "2",
                          "--num-requests", "2", "--output-len", "3", "--json"])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["torch_threads"] == 1 and row["num_requests"] == 2 and len(row["round_ratios"]) == 2
    assert row["digest_direct"] == row["digest_torch_op"] and len(row["digest_direct"]) == 1
    assert row["forward_ms_direct"] > 0 and row["forward_ms_torch_op"] > 0
    assert row["direct_linears"][0] >= 4 * 4 + 1 and row["direct_linears"][1] == 0  # tiny-llama: 4 layers x 4, LM head
    assert cpu_linear._DIRECT[0] is onednn.matmul_module()
