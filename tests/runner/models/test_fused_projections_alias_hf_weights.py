"""q/k/v and gate/up run as one matmul over a fused buffer whose row slices *are* the HF
parameters (``runner/models/fused.py``): loading HF weights fills the fused buffer in HF
order, ``state_dict()`` keeps exactly HF's keys, ``.to()`` keeps the aliasing, and the
fused forward equals the three (two) separate projections."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnplug.runner.models import build_model  # noqa: E402
from attnplug.runner.models.fused import FusedProjections, fusion_intact  # noqa: E402
from tests.runner.models.test_parity_prefix_caching import GEMMA3  # noqa: E402
from tests.runner.models.test_parity_qwen3_next import QWEN3_NEXT  # noqa: E402

QWEN2 = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)


def hf_qwen2():
    """A tiny random HF Qwen2 (q/k/v biases: the bias rows are fused too); non-zero biases."""
    torch.manual_seed(7)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    return hf


def fused_modules(model):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FusedProjections)]


def test_loaded_hf_weights_fill_the_fused_buffers_in_hf_order():
    hf = hf_qwen2()
    sd = hf.state_dict()
    ours = build_model(hf.config, block_size=4)
    ours.load_hf_state_dict(sd)
    assert set(ours.state_dict()) == set(sd)  # HF keys only: no fused key is saved or expected
    checked = 0
    for i in range(QWEN2["num_hidden_layers"]):
        attn, mlp = ours.model.layers[i].self_attn, ours.model.layers[i].mlp
        p = f"model.layers.{i}."
        for suffix in ("weight", "bias"):
            want = torch.cat([sd[f"{p}self_attn.{x}_proj.{suffix}"] for x in "qkv"])
            assert torch.equal(attn._buffers[f"qkv_{suffix}"], want), (i, suffix)
        want = torch.cat([sd[f"{p}mlp.gate_proj.weight"], sd[f"{p}mlp.up_proj.weight"]])
        assert torch.equal(mlp._buffers["gate_up_weight"], want)
        checked += 1
    assert checked == QWEN2["num_hidden_layers"] and fusion_intact(ours)


@pytest.mark.parametrize("cfg, kinds", [(QWEN2 | {"model_type": "qwen2"}, {"Attention", "SwiGLUMLP"}),
                                         (GEMMA3, {"Gemma3Attention", "Gemma3MLP"}),
                                         (QWEN3_NEXT, {"GatedAttention", "SwiGLUMLP"})],
                         ids=["qwen2", "gemma3", "qwen3_next"])
def test_fused_forward_equals_the_separate_projections(cfg, kinds):
    model = build_model(cfg, block_size=4, seed=3)
    mods = fused_modules(model)
    assert {type(m).__name__ for _, m in mods} == kinds
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for name, m in mods:
        for group, parts in m.fused_parts.items():
            with torch.no_grad():
                fused = m.project(group, x)
                separate = [getattr(m, part)(x) for part in parts]
            assert len(fused) == len(separate)
            for part, a, b in zip(parts, fused, separate):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{name}.{part}")


def test_dtype_conversion_restacks_and_keeps_loading_into_the_fused_buffer():
    hf = hf_qwen2()
    ours = build_model(hf.config, block_size=4).to(torch.float64)
    assert fusion_intact(ours)
    ours.load_hf_state_dict(hf.state_dict())  # copies into the (converted) HF parameters
    attn = ours.model.layers[0].self_attn
    assert attn._buffers["qkv_weight"].dtype == torch.float64
    want = torch.cat([hf.state_dict()[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]).double()
    assert torch.equal(attn._buffers["qkv_weight"], want)


def test_replacing_a_parameter_is_seen_as_broken_fusion():
    model = build_model(QWEN2 | {"model_type": "qwen2"}, block_size=4)
    assert fusion_intact(model)
    k = model.model.layers[1].self_attn.k_proj
    k.weight.data = k.weight.data.clone()
    assert not fusion_intact(model)
