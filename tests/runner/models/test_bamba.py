"""Bamba: config normalization, cache specs per layer kind, HF parameter names, strict loading."""

from __future__ import annotations

import pytest
import torch

from attnplug.cache_groups.grouping import group_layers_by_spec
from attnplug.cache_groups.specs import FullAttentionSpec, MambaSpec
from attnplug.core.mamba import MambaLayerConfig
from attnplug.runner.models import (
    BambaModel,
    ModelConfigError,
    UnsupportedModelError,
    WeightLoadError,
    build_model,
    model_layer_configs,
    resolve_model_config,
)

CFG = {"model_type": "bamba", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
       "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_indices": [2], "mamba_n_heads": 8,
       "mamba_d_state": 6, "mamba_n_groups": 2, "mamba_chunk_size": 16}


def test_config_normalization_follows_hf_defaults():
    cfg = resolve_model_config(CFG)
    assert cfg.layer_types == ("mamba", "mamba", "full_attention")
    assert cfg.mamba_head_size == 2 * 32 // 8 and cfg.mamba_d_conv == 4 and cfg.time_step_limit == (0.0, float("inf"))
    assert cfg.head_size == 8 and cfg.rotary_dim == 4, "Bamba rotates half of each head (partial_rotary_factor 0.5)"
    assert cfg.mamba_conv_dim == 64 + 2 * 2 * 6
    full = resolve_model_config({**CFG, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                            "partial_rotary_factor": 1.0}})
    assert full.rotary_dim == 8
    assert resolve_model_config({**CFG, "model_type": None, "architectures": ["BambaForCausalLM"]}).model_type == "bamba"


@pytest.mark.parametrize("change, match", [
    ({"mamba_d_head": 5}, "mamba_n_heads \\* mamba_d_head"),
    ({"mamba_n_groups": 3}, "not a multiple of mamba_n_groups"),
    ({"attn_layer_indices": [7]}, "outside"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_invalid_configs_are_rejected_with_the_field(change, match):
    with pytest.raises(ModelConfigError, match=match):
        resolve_model_config({**CFG, **change})


def test_unsupported_model_lists_bamba():
    with pytest.raises(UnsupportedModelError, match="bamba \\(BambaForCausalLM\\)"):
        resolve_model_config({**CFG, "model_type": "jamba"})


def test_layers_specs_and_groups():
    model = build_model(CFG, block_size=4)
    assert isinstance(model, BambaModel)
    assert model.layer_names == ["model.layers.0.mamba", "model.layers.1.mamba", "model.layers.2.self_attn.attn"]
    layer_cfgs = model_layer_configs(resolve_model_config(CFG), torch.float32, "cpu", 4)
    assert isinstance(layer_cfgs["model.layers.0.mamba"], MambaLayerConfig)
    specs = model.kv_cache_specs(4)
    m = specs["model.layers.0.mamba"]
    assert isinstance(m, MambaSpec) and m.conv_state_shape == (88, 3) and m.ssm_state_shape == (8, 8, 6)
    assert m.chunk_size == 16 and m.ssm_dtype == torch.float32
    assert isinstance(specs["model.layers.2.self_attn.attn"], FullAttentionSpec)
    groups = group_layers_by_spec(specs)
    assert [len(g.layer_names) for g in groups] == [2, 1] and groups[0].kv_cache_spec.kind == "mamba"
    assert model.mamba_layers["model.layers.1.mamba"].impl.layer_config.chunk_size == 16


def test_parameter_names_match_hf_and_loading_is_strict():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CFG))
    sd = hf.state_dict()
    ours = build_model(CFG, block_size=4)
    assert set(dict(ours.named_parameters())) == set(sd)
    ours.load_hf_state_dict(sd)
    assert torch.equal(ours.model.layers[0].mamba.A_log, sd["model.layers.0.mamba.A_log"])
    before = ours.model.layers[1].mamba.in_proj.weight.clone()
    bad = {k: v for k, v in sd.items() if k != "model.layers.1.mamba.D"}
    bad["model.layers.1.mamba.in_proj.weight"] = torch.zeros_like(before)
    with pytest.raises(WeightLoadError, match="model.layers.1.mamba.D"):
        ours.load_hf_state_dict(bad)
    assert torch.equal(ours.model.layers[1].mamba.in_proj.weight, before), "a failed load changed the model"
