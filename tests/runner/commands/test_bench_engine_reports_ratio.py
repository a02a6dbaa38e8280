"""``attnplug bench engine`` (runner/commands/bench/engine.py): its figures, its greedy agreement,
its checkpoint for vLLM, and its errors. The run against vLLM itself is in
``tests/vllm/test_vllm_bench_engine.py`` (the 0.32 environment)."""

from __future__ import annotations

import json

import pytest
import torch

from attnplug.runner.commands.bench import engine


def test_agreement_counts_identical_requests_and_prefix_share():
    got = engine.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 6, 0, 8]])
    assert got == {"identical_requests": 1, "requests": 2, "mean_prefix_share": 0.75}


def test_per_step_splits_wall_time_into_forward_and_host():
    f = engine.per_step({"wall_s": 2.0, "forward_s": 1.5, "steps": 100, "generated_tokens": 400})
    assert f["generated_tokens_per_s"] == 200.0
    assert f["forward_ms_per_step"] == pytest.approx(15.0)
    assert f["host_ms_per_step"] == pytest.approx(5.0)


def test_checkpoint_holds_the_models_parameters_under_hf_names(tmp_path):
    from safetensors.torch import load_file

    from attnplug.runner.models.presets import make_preset_model

    model = make_preset_model("tiny-llama")
    engine.write_checkpoint(model, engine.hf_config("tiny-llama"), str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    params = dict(model.named_parameters())
    assert set(saved) == set(params) and "lm_head.weight" in saved
    assert all(torch.equal(saved[k], params[k].float()) for k in params)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_attnplug_alone_prints_figures_and_thread_count(capsys):
    rc = engine.main(["--vllm-python", "none", "--repeat", "2", "--num-requests", "3", "--output-len", "3",
                      "--max-num-seqs", "3", "--max-model-len", "256", "--threads", "1", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["rows"]
    assert row["torch_threads"] == 1 and row["model"] == "tiny-llama" and row["rounds"] == 2
    assert row["outputs_identical_across_rounds"]
    assert row["attnplug"]["generated_tokens_per_s"] > 0 and row["attnplug"]["steps"] >= 3
    assert "vllm" not in row


def test_missing_vllm_python_is_one_line_and_exit_2(capsys, tmp_path):
    assert engine.main(["--vllm-python", str(tmp_path / "nope"), "--repeat", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--vllm-python" in err and "\n" not in err
    assert engine.main(["--threads", "0"]) == 2
