"""The decoder layer ropes q and k straight from the fused q/k/v projection's output
(``cpu_ops.rope_qk``): bit-identical to RoPE on the split views, one call a layer, refused
input changes nothing, and a layer that normalises q and k first (Qwen3) keeps the split path."""

from __future__ import annotations

import pytest
import torch

from attnplug.runner.models import build_model, cpu_ops
from attnplug.runner.models.layers import Attention

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="runner/models/_cpu_ops is not built")


def _inputs(n: int, heads: int, kv_heads: int, head_size: int, rotary_dim: int):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_size, generator=g)
    angles = torch.arange(n).float()[:, None] * torch.rand(rotary_dim // 2, generator=g)
    return qkv, angles.cos()[:, None], angles.sin()[:, None]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("heads, kv_heads, head_size, rotary_dim", [(8, 2, 32, 32), (3, 1, 64, 32), (4, 4, 16, 16)])
def test_q_and_k_equal_rope_on_the_split_views(heads, kv_heads, head_size, rotary_dim, interleaved):
    n = 9
    qkv, cos, sin = _inputs(n, heads, kv_heads, head_size, rotary_dim)
    before = qkv.clone()
    q, k = cpu_ops.rope_qk(qkv, heads, kv_heads, head_size, cos, sin, rotary_dim, interleaved)
    q_view, k_view, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    assert torch.equal(q, cpu_ops.rope(q_view.view(n, heads, head_size), cos, sin, rotary_dim, interleaved))
    assert torch.equal(k, cpu_ops.rope(k_view.view(n, kv_heads, head_size), cos, sin, rotary_dim, interleaved))
    assert q.is_contiguous() and k.is_contiguous() and torch.equal(qkv, before)


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "qkv": a["qkv"][:, :-32]}, "columns"),
    (lambda a: {**a, "qkv": a["qkv"].double()}, "float32"),
    (lambda a: {**a, "qkv": a["qkv"].t().contiguous().t()}, "contiguous last"),
    (lambda a: {**a, "num_kv_heads": 0}, "positive"),
    (lambda a: {**a, "rotary_dim": 31}, "rotary_dim"),
    (lambda a: {**a, "cos": a["cos"][:-1]}, "cos"),
    (lambda a: {**a, "sin": a["sin"].double()}, "sin"),
])
def test_bad_input_is_refused(change, match):
    qkv, cos, sin = _inputs(5, 8, 2, 32, 32)
    args = change(dict(qkv=qkv, num_heads=8, num_kv_heads=2, head_size=32, cos=cos, sin=sin, rotary_dim=32))
    with pytest.raises(ValueError, match=match):
        cpu_ops.rope_qk(**args)


def _count_calls(model, monkeypatch) -> dict[str, int]:
    from tests.runner.models.test_hf_forward_parity import run_schedule

    calls: dict[str, int] = {}
    for name in ("rope", "rope_qk"):
        real = getattr(cpu_ops, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*a, **k)
        monkeypatch.setattr(cpu_ops, name, counted)
    run_schedule(model, [[5, 9, 2, 7, 1, 3], [4, 6]], [[(0, 5), (1, 2)], [(0, 1)]])
    monkeypatch.undo()
    return calls


def test_a_llama_layer_ropes_once_a_step_and_qwen3_keeps_its_norms_first(monkeypatch):
    from tests.runner.models.test_hf_forward_parity import SIZES

    sizes = dict(SIZES, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    llama = build_model({**sizes, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    qwen3 = build_model({**sizes, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 8})
    steps, layers = 2, SIZES["num_hidden_layers"]
    assert _count_calls(llama, monkeypatch) == {"rope_qk": steps * layers}
    assert _count_calls(qwen3, monkeypatch) == {"rope": 2 * steps * layers}
    assert llama.model.layers[0].self_attn.fuses_qk_rope()
    assert not qwen3.model.layers[0].self_attn.fuses_qk_rope()
    assert type(qwen3.model.layers[0].self_attn).normalize_qk is not Attention.normalize_qk
