"""The bridged backend through vLLM's own objects, without an engine: what runs on this CPU
for every supported minor (on 0.33, whose compiled kernels do not load here, the deepest
test of the bridge there is; docs/vllm.md says what is not driven).

vLLM's part: a real ``VllmConfig`` read from a tiny Llama ``config.json``; vLLM's
``Attention`` layer made with the bridged backend (so the impl is constructed by vLLM, with
vLLM's arguments); the layer's own KV-cache spec; the minor's KV-cache planning and layout
negotiation as its engine core runs them (``ADAPTER.plan_kv_cache``); the bridged builder
constructed and called with vLLM's signatures; the impl called as vLLM's ``Attention`` calls
it. The ``CommonAttentionMetadata`` is vLLM's dataclass, filled here as its model runner
fills it (padded like a CUDA-graph batch: one extra token with slot -1), because the
runner's slot-mapping kernel needs vLLM's compiled ops. Two steps: request A's prefill in
two chunks, B prefilled in the first step and decoding in the second. Outputs are compared
with dense causal attention over the whole token history.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from vllm_steps import vllm_step  # noqa: E402

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 4, 2, 32, 16


@pytest.fixture(scope="module")
def vllm_layer(tmp_path_factory, vllm_installed):
    from attnplug.backends.torch_native import TorchNativeBackend
    from attnplug.plugins.vllm import _vllm as V
    from attnplug.plugins.vllm.adapter import bridge_classes
    from vllm.config import CacheConfig

    d = tmp_path_factory.mktemp("vllm-layer")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": HEADS * HEAD_SIZE, "head_dim": HEAD_SIZE, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 512}))
    model = V.ModelConfig(model=str(d), dtype=torch.float32, skip_tokenizer_init=True, max_model_len=128)
    config = V.VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK))
    backend = bridge_classes(TorchNativeBackend, "CUSTOM")
    with V.set_current_vllm_config(config):
        layer = V.Attention(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, num_kv_heads=KV_HEADS,
                            prefix="model.layers.0.self_attn.attn", attn_backend=backend)
    return V, config, backend, layer


def _allocate(V, layout, num_blocks: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """vLLM's logical per-layer cache ``[num_blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE]`` in
    ``layout``'s physical order (its ``layer_view_order``), as vLLM's runner reshapes it
    (``torch.uint8`` for an fp8 cache, as vLLM allocates it)."""
    logical = (num_blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE)
    order = layout.layer_view_order
    poison = 0x7F if dtype == torch.uint8 else 1e3  # 0x7F: NaN as e4m3fn and as e5m2
    phys = torch.full([logical[i] for i in order], poison, dtype=dtype)  # poison: a read of an unwritten slot shows
    return phys.permute([order.index(i) for i in range(4)])


def _dense(q, k, v, sinks=None):
    """Causal attention of the last ``len(q)`` positions of ``k``/``v`` (one request); with
    ``sinks`` (``[HEADS]``) an extra logit per head in the softmax denominator, no value."""
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    start = k.shape[0] - q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_SIZE ** -0.5
    mask = torch.arange(k.shape[0])[None, :] > (start + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(-1, q.shape[0], 1)], dim=-1)
    probs = scores.softmax(-1)[..., : k.shape[0]]
    return torch.einsum("hqk,khd->qhd", probs, v)


def test_vllm_plans_the_cache_in_a_layout_the_bridge_declared(vllm_layer):
    V, config, backend, layer = vllm_layer
    spec = layer.get_kv_cache_spec(config)
    assert (spec.block_size, spec.num_kv_heads, spec.head_size) == (BLOCK, KV_HEADS, HEAD_SIZE)
    names = [layout.name for layout in backend.supported_kv_cache_layouts()]
    kv_config, layout = V.plan_kv_cache(config, {layer.layer_name: spec}, 40 * spec.page_size_bytes, names)
    assert layout.name in ("LBHNC", "LBNHC") and layout.is_block_compact
    assert kv_config.num_blocks == 40
    assert [g.layer_names for g in kv_config.kv_cache_groups] == [[layer.layer_name]]


def _two_steps_match_dense(V, config, backend, layer, sinks=None, fp8=None):
    """Two steps through ``layer`` (A: chunks of 21 and 16; B: 8 prompt tokens, then a
    decode) == dense attention (with ``sinks`` when given; over K/V quantised to ``fp8`` with
    the layer's ``_k_scale`` / ``_v_scale`` and dequantised, when given); padding rows untouched."""
    spec = layer.get_kv_cache_spec(config)
    names = [layout.name for layout in backend.supported_kv_cache_layouts()]
    kv_config, layout = V.plan_kv_cache(config, {layer.layer_name: spec}, 12 * spec.page_size_bytes, names)
    cache = _allocate(V, layout, kv_config.num_blocks, torch.uint8 if fp8 is not None else torch.float32)
    with V.set_current_vllm_config(config):
        builder = backend.get_builder_cls()(spec, [layer.layer_name], config, torch.device("cpu"))
    assert isinstance(layer.impl, backend.get_impl_cls())

    g = torch.Generator().manual_seed(0)
    total = {"A": 37, "B": 9}
    k_all = {r: torch.randn(n, KV_HEADS, HEAD_SIZE, generator=g) for r, n in total.items()}
    v_all = {r: torch.randn(n, KV_HEADS, HEAD_SIZE, generator=g) for r, n in total.items()}
    q_all = {r: torch.randn(n, HEADS, HEAD_SIZE, generator=g) for r, n in total.items()}
    blocks = [[3, 7, 1], [5]]
    for computed, scheduled in (([0, 0], [21, 8]), ([21, 8], [16, 1])):
        pad = 3
        cm = vllm_step(V, computed, scheduled, blocks, pad, BLOCK,
                       [c + s < 40 for c, s in zip(computed, scheduled)])
        rows = [(r, c, c + s) for r, c, s in zip("AB", computed, scheduled)]
        q = torch.cat([q_all[r][a:b] for r, a, b in rows] + [torch.randn(pad, HEADS, HEAD_SIZE, generator=g)])
        k = torch.cat([k_all[r][a:b] for r, a, b in rows] + [torch.randn(pad, KV_HEADS, HEAD_SIZE, generator=g)])
        v = torch.cat([v_all[r][a:b] for r, a, b in rows] + [torch.randn(pad, KV_HEADS, HEAD_SIZE, generator=g)])
        with V.set_current_vllm_config(config):
            metadata = builder.build(0, cm, fast_build=False)
        out = torch.full_like(q, 7.0)
        assert layer.impl.forward(layer, q, k, v, cache, metadata, out) is out
        k_ref, v_ref = k_all, v_all
        if fp8 is not None:  # what the cache holds, read back: (x / scale) in fp8, times scale
            ks, vs = float(layer._k_scale), float(layer._v_scale)
            k_ref = {r: (t / ks).to(fp8).float() * ks for r, t in k_all.items()}
            v_ref = {r: (t / vs).to(fp8).float() * vs for r, t in v_all.items()}
        want = torch.cat([_dense(q_all[r][a:b], k_ref[r][:b], v_ref[r][:b], sinks) for r, a, b in rows])
        n = sum(scheduled)
        torch.testing.assert_close(out[:n], want, atol=1e-5, rtol=1e-5)
        assert (out[n:] == 7.0).all()  # padding rows untouched


def test_bridged_builder_and_impl_called_as_vllm_calls_them_match_dense_attention(vllm_layer):
    V, config, backend, layer = vllm_layer
    _two_steps_match_dense(V, config, backend, layer)


def test_sinks_given_to_vllms_layer_reach_the_attnplug_impl(vllm_layer):
    """gpt-oss's way: the model's sink parameter (its dtype) passed to vLLM's ``Attention``,
    its values loaded after the impl is built."""
    V, config, backend, _ = vllm_layer
    sinks = torch.nn.Parameter(torch.zeros(HEADS), requires_grad=False)
    with V.set_current_vllm_config(config):
        layer = V.Attention(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, num_kv_heads=KV_HEADS, sinks=sinks,
                            prefix="model.layers.1.self_attn.attn", attn_backend=backend)
    sinks.data.copy_(torch.tensor([2.0, -1.0, 0.5, 4.0]))  # "weight loading", after construction
    buffer = layer.impl.sinks32
    _two_steps_match_dense(V, config, backend, layer, sinks.detach())
    # one persistent float32 buffer, refreshed in place: no conversion allocated per forward
    assert layer.impl.sinks32 is buffer and layer.impl.inner.sinks is buffer and buffer.dtype == torch.float32
    sinks.data.copy_(torch.tensor([0.0, 1.0, -2.0, 3.0]))  # a reload reaches the same buffer
    _two_steps_match_dense(V, config, backend, layer, sinks.detach())
    assert layer.impl.inner.sinks is buffer and buffer.tolist() == [0.0, 1.0, -2.0, 3.0]


@pytest.mark.parametrize("cache_dtype, fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_an_fp8_cache_of_vllm_is_read_with_its_layers_scales(vllm_layer, cache_dtype, fp8):
    """vLLM's fp8 cache (uint8, its ``"fp8"`` = e4m3) through the bridge: the layer's
    non-unit per-tensor descales used on write and read (ignoring either fails)."""
    from vllm.config import CacheConfig

    V, config, backend, _ = vllm_layer
    fp8_config = V.VllmConfig(model_config=config.model_config,
                              cache_config=CacheConfig(block_size=BLOCK, cache_dtype=cache_dtype))
    with V.set_current_vllm_config(fp8_config):
        layer = V.Attention(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, num_kv_heads=KV_HEADS,
                            cache_config=fp8_config.cache_config,
                            prefix=f"model.layers.2.self_attn.attn.{cache_dtype}", attn_backend=backend)
    assert layer.impl.cache_dtype == fp8
    layer._k_scale.fill_(0.25)
    layer._v_scale.fill_(3.0)
    _two_steps_match_dense(V, fp8_config, backend, layer, fp8=fp8)


def test_vllm_features_the_bridge_refuses_fail_inside_vllms_own_layer(vllm_layer):
    from attnplug.core.errors import BackendUnsupportedError

    V, config, backend, _ = vllm_layer
    with V.set_current_vllm_config(config), pytest.raises(BackendUnsupportedError, match="ALiBi") as e:
        V.Attention(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, num_kv_heads=KV_HEADS, alibi_slopes=[0.5] * HEADS,
                    prefix="model.layers.9.self_attn.attn", attn_backend=backend)
    assert "torch_native" in str(e.value) and "vLLM" in str(e.value)
