"""``rope.rope_frequencies``, the one RoPE function, gives transformers' own inverse frequencies
and attention factor bit for bit for every variant (default, linear, llama3, YaRN with and
without DeepSeek's mscale pair, untruncated, partial rotary); the interleaved pairing equals
HF DeepSeek-V3's ``apply_rotary_pos_emb_interleave``; DeepSeek's softmax-scale correction
equals ``yarn_apply_mscale``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from attnplug.runner.models.config import ModelConfigError, parse_rope  # noqa: E402
from attnplug.runner.models.rope import (RotaryEmbedding, rope_frequencies, rotary_dim_of, rotate,  # noqa: E402
                                         yarn_softmax_scale)

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}
VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    "yarn": YARN,
    "yarn-deepseek-mscale": {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32,
                             "beta_slow": 1},
    "yarn-no-truncate": {**YARN, "truncate": False, "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn-attention-factor": {**YARN, "attention_factor": 1.25},
    "yarn-partial": {**YARN, "partial_rotary_factor": 0.5},
    "linear-partial": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}


def _hf_config(params: dict):
    return transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64, max_position_embeddings=2048,
                                    rope_parameters=dict(params))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rope_frequencies_equal_hf(name):
    hf_cfg = _hf_config(VARIANTS[name])
    kind = VARIANTS[name]["rope_type"]
    if kind == "default":
        dim = 64
        ref = 1.0 / (hf_cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        ref_factor = 1.0
    else:
        ref, ref_factor = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    theta, scaling = parse_rope(hf_cfg.to_dict())
    inv_freq, factor = rope_frequencies(rotary_dim_of(64, scaling), theta, scaling)
    assert inv_freq.shape == ref.shape and torch.equal(inv_freq, ref.float()), (inv_freq - ref).abs().max()
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    if "mscale" in name:
        assert factor == pytest.approx((0.1 * 1.0 * torch.log(torch.tensor(40.0)).item() + 1)
                                       / (0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1))


def test_yarn_attention_factor_scales_cos_and_sin():
    theta, scaling = parse_rope({"rope_parameters": YARN})
    rope = RotaryEmbedding(64, theta, scaling, "cpu")
    cos, sin = rope.cos_sin(torch.arange(5), torch.float32)
    angles = torch.arange(5).float().unsqueeze(-1) * rope.inv_freq
    factor = 0.1 * torch.log(torch.tensor(8.0)).item() + 1
    assert rope.attention_factor == pytest.approx(factor) and factor > 1.2
    torch.testing.assert_close(cos[:, 0], angles.cos() * factor)
    torch.testing.assert_close(sin[:, 0], angles.sin() * factor)


def test_interleaved_rotation_equals_hf_deepseek_v3():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    n, heads, d = 7, 3, 16
    theta, scaling = parse_rope({"rope_theta": 10000.0, "rope_interleave": True})
    rope = RotaryEmbedding(d, theta, scaling, "cpu")
    q, k = torch.randn(n, heads, d), torch.randn(n, 1, d)
    cos, sin = rope.cos_sin(torch.arange(n), torch.float32)
    angles = torch.arange(n).float().unsqueeze(-1) * rope.inv_freq
    emb = torch.cat([angles, angles], dim=-1).unsqueeze(0)  # HF: [batch, seq, dim]
    ref_q, ref_k = apply_rotary_pos_emb_interleave(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                                   emb.cos(), emb.sin())
    assert torch.equal(rope.apply(q, cos, sin), ref_q[0].transpose(0, 1))
    assert torch.equal(rope.apply(k, cos, sin), ref_k[0].transpose(0, 1))
    assert not torch.equal(rotate(q, cos, sin), rotate(q, cos, sin, interleaved=True))


def test_deepseek_softmax_scale_equals_hf():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    params = {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707}
    _, scaling = parse_rope({"rope_parameters": params})
    assert yarn_softmax_scale(scaling) == pytest.approx(yarn_apply_mscale(params, 1.0), rel=1e-12) != 1.0
    assert yarn_softmax_scale(parse_rope({"rope_theta": 1e4})[1]) == 1.0


@pytest.mark.parametrize("params, match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": "x"}, "original_max_position"),
    ({"rope_type": "yarn", "factor": "big", "original_max_position_embeddings": 64}, "factor"),
    ({"rope_type": "default", "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
])
def test_bad_rope_parameters_name_the_field(params, match):
    with pytest.raises(ModelConfigError, match=match):
        parse_rope({"rope_parameters": params, "max_position_embeddings": 128})
