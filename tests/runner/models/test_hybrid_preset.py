"""The hybrid preset (``attnplug run --model tiny-hybrid``, the default before real weights):
full-attention, sliding-window and Mamba2 layers (``attnplug_hybrid``), so every step serves three kinds of cache group."""

from __future__ import annotations

import json

import pytest

from attnplug.cache_groups.grouping import group_layers_by_spec
from attnplug.cache_groups.specs import MambaSpec, SlidingWindowSpec
from attnplug.runner.models import ModelConfigError, build_model, preset_config, resolve_model_config
from attnplug.runner.models.hybrid import HybridModel, HybridModelConfig
from attnplug.runner.models.presets import RUN_PRESET
from attnplug.runner.commands.run import main as _run_main


def run_main(argv: list[str]) -> int:
    """``attnplug run`` on the random-weight preset these tests were written for (the
    default model is now SmolLM2's real weights), unless ``argv`` names a model."""
    return _run_main(argv if "--model" in argv else ["--model", "tiny-hybrid", *argv])


def test_run_preset_has_full_sliding_and_mamba_groups():
    cfg = resolve_model_config(preset_config(RUN_PRESET))
    assert isinstance(cfg, HybridModelConfig)
    assert cfg.layer_kinds == ("sliding_attention", "mamba", "full_attention", "mamba")
    model = build_model(preset_config(RUN_PRESET), block_size=16)
    assert isinstance(model, HybridModel)
    groups = group_layers_by_spec(model.kv_cache_specs(16))
    assert [g.kv_cache_spec.kind for g in groups] == ["sliding_window", "mamba", "full_attention"]
    assert isinstance(groups[0].kv_cache_spec, SlidingWindowSpec) and groups[0].kv_cache_spec.sliding_window == 64
    assert isinstance(groups[1].kv_cache_spec, MambaSpec) and len(groups[1].layer_names) == 2
    sliding = model.model.layers[0].self_attn
    assert sliding.impl.sliding_window == 64 and model.model.layers[2].self_attn.impl.sliding_window is None
    assert model.layer_configs(16)["model.layers.0.self_attn.attn"].sliding_window == 64


@pytest.mark.parametrize("change, match", [
    ({"sliding_attn_layer_indices": [1]}, "not attention layers"),
    ({"sliding_window": None}, "positive int"),
    ({"sliding_window": 0}, "positive int"),
])
def test_bad_hybrid_configs(change, match):
    with pytest.raises(ModelConfigError, match=match):
        resolve_model_config({**preset_config(RUN_PRESET), **change})


def test_run_reports_peak_blocks_per_group_and_state_slots(capsys, monkeypatch):
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")  # invariants, sliding-window nulls included, every step
    assert run_main(["--num-requests", "12", "--max-num-seqs", "6", "--invariance-requests", "2", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    kinds = [g["kind"] for g in s["cache_groups"]]
    assert kinds == ["sliding_window", "mamba", "full_attention"]
    sliding, mamba, full = s["peak_kv_blocks_per_group"]
    assert s["cache_groups"][1]["capacity"] == 6 and 0 < mamba <= 6  # one state slot per running request
    assert 0 < sliding < full  # the window frees blocks the full-attention group keeps
    assert s["cache_groups"][0]["sliding_window"] == 64
    assert s["batch_invariance"] == {"identical": 2, "checked": 2}
    assert s["metadata_builds_per_step"] == 3.0
    run_main(["--num-requests", "2", "--invariance-requests", "0"])
    out = capsys.readouterr().out
    assert "state slots" in out and "KV blocks" in out and "sliding W=64" in out
