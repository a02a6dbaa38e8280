"""An attnplug MLA backend inside vLLM's own ``MLAAttention`` layer (its MLA impl interface:
``do_kv_cache_update``, ``forward_mha``, ``forward_mqa``), at the interface level, for every
supported minor.

vLLM's part: a real ``VllmConfig`` read from a tiny DeepSeek-V2 ``config.json``; vLLM's
``MLAAttention`` made with the bridged backend (so vLLM constructs the impl with its MLA
arguments and picks its prefill machinery), with a ``ColumnParallelLinear`` ``kv_b_proj``
(a one-process gloo tensor-parallel group); its ``process_weights_after_loading`` (vLLM
splits ``kv_b_proj`` into its own ``W_UK_T`` / ``W_UV``); the bridged builder called with
vLLM's ``CommonAttentionMetadata``; then the layer's own step, as its ``forward`` runs it:
``update_kv_cache`` (-> ``do_kv_cache_update``) and ``forward_impl`` (vLLM absorbs ``W_UK``
into the decode queries, calls ``forward_mqa``, applies ``W_UV``; prefill rows go to
``forward_mha``). Two steps: A and B prefilled, then B decoding (first, as vLLM orders
decodes) beside A's second chunk over 21 cached tokens. The output equals attnplug's own
``torch_native_mla`` impl run on the same inputs and cache (the reference).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from vllm_steps import vllm_step  # noqa: E402

N, L, R, P, VD, BLOCK = 4, 32, 16, 24, 20, 16
"""heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, block size."""

DEEPSEEK = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "num_hidden_layers": 1,
            "hidden_size": 64, "num_attention_heads": N, "num_key_value_heads": N, "kv_lora_rank": L,
            "q_lora_rank": None, "qk_rope_head_dim": R, "qk_nope_head_dim": P, "v_head_dim": VD,
            "intermediate_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "vocab_size": 64, "max_position_embeddings": 512, "first_k_dense_replace": 1}


@pytest.fixture(scope="module")
def mla_layer(tmp_path_factory, vllm_installed):
    from attnplug.backends.mla.torch_native.backend import TorchNativeMLABackend
    from attnplug.plugins.vllm import _vllm as V
    from attnplug.plugins.vllm.adapter import bridge_classes
    from vllm.config import CacheConfig
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    d = tmp_path_factory.mktemp("vllm-mla")
    (d / "config.json").write_text(json.dumps(DEEPSEEK))
    model = V.ModelConfig(model=str(d), dtype=torch.float32, skip_tokenizer_init=True, max_model_len=128)
    config = V.VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK))
    backend = bridge_classes(TorchNativeMLABackend, "CUSTOM")
    assert backend.is_mla()
    with V.set_current_vllm_config(config):
        _one_process_model_parallel()
        kv_b_proj = ColumnParallelLinear(L, N * (P + VD), bias=False, prefix="model.layers.0.self_attn.kv_b_proj")
        with torch.no_grad():  # "weight loading": [N * (P + V), L], per head the k_nope rows then the v rows
            kv_b_proj.weight.copy_(torch.randn(N * (P + VD), L, generator=torch.Generator().manual_seed(1)) * L ** -0.5)
        layer = MLAAttention(num_heads=N, scale=(P + R) ** -0.5, qk_nope_head_dim=P, qk_rope_head_dim=R,
                             v_head_dim=VD, q_lora_rank=None, kv_lora_rank=L, kv_b_proj=kv_b_proj,
                             cache_config=config.cache_config, prefix="model.layers.0.self_attn.attn",
                             attn_backend=backend)
        layer.process_weights_after_loading(torch.float32)
    return V, config, backend, layer


def _one_process_model_parallel() -> None:
    """vLLM's tensor-parallel group of one process (gloo), as its CPU worker sets it up:
    ``kv_b_proj`` is a ``ColumnParallelLinear``, as in vLLM's DeepSeek models."""
    import socket

    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    ps.initialize_model_parallel(1, 1)


def test_torch_native_mla_in_vllms_mla_layer_equals_attnplugs_reference(mla_layer):
    from attnplug.backends.mla.torch_native.backend import TorchNativeMLABackend
    from attnplug.core.mla import MLALayerConfig
    from attnplug.plugins.vllm.metadata import from_vllm

    V, config, backend, layer = mla_layer
    assert type(layer.impl).__name__ == "Attnplug_torch_native_mla_Impl"
    spec = layer.get_kv_cache_spec(config)
    assert (spec.block_size, spec.head_size) == (BLOCK, L + R)
    with V.set_current_vllm_config(config):
        builder = backend.get_builder_cls()(spec, [layer.layer_name], config, torch.device("cpu"))
    ref_impl = TorchNativeMLABackend.get_impl_cls()(MLALayerConfig(num_heads=N, kv_lora_rank=L, qk_nope_head_dim=P,
                                                                   qk_rope_head_dim=R, v_head_dim=VD), layer.scale)
    cache = torch.full((12, BLOCK, L + R), 1e3)  # poison: a read of an unwritten slot shows
    ref_cache = cache.clone()
    g = torch.Generator().manual_seed(0)
    blocks = {"A": [3, 7, 1], "B": [5]}
    # step 1: A (21) and B (8) prefill; step 2: B decodes (first, as vLLM orders decodes), A's next 16
    for order, computed, scheduled in ((["A", "B"], [0, 0], [21, 8]), (["B", "A"], [8, 21], [1, 16])):
        pad = 3
        cm = vllm_step(V, computed, scheduled, [blocks[r] for r in order], pad, BLOCK, [s > 1 for s in scheduled])
        T = sum(scheduled) + pad
        q = torch.randn(T, N, P + R, generator=g)
        kv_c, k_pe = torch.randn(T, L, generator=g), torch.randn(T, 1, R, generator=g)
        with V.set_current_vllm_config(config):
            md = builder.build(0, cm)
            assert (md.num_decodes, md.num_prefills) == ((0, 2) if computed == [0, 0] else (1, 1))
            layer.update_kv_cache(kv_c, k_pe, cache, cm.slot_mapping, md, "auto", layer._k_scale)
            out = torch.full((T, N * VD), 7.0)
            layer.forward_impl(q, kv_c, k_pe, cache, md, output=out)
        ref_md = TorchNativeMLABackend.get_builder_cls()(
            _ref_spec(), ["ref"], _limits(config), "cpu").build(0, from_vllm(cm))
        ref = torch.full((T, N, VD), 7.0)
        ref_impl.forward(layer, q, kv_c, k_pe.view(T, R), ref_cache, ref_md, ref)
        n = sum(scheduled)
        torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)  # the latent rows, written alike
        # float32 in two orders (vLLM's kv_b_proj through its CPU GEMM, the reference through
        # torch): ~1e-5 apart, once 5.5e-5 (4.7 % of the elements, one make test of session 15;
        # not reproduced in five reruns); a wrong row or head is off by O(1)
        torch.testing.assert_close(out[:n].view(n, N, VD), ref[:n], atol=1e-4, rtol=1e-4)


def _ref_spec():
    from attnplug.cache_groups.specs import MLAAttentionSpec

    return MLAAttentionSpec(block_size=BLOCK, kv_lora_rank=L, qk_rope_head_dim=R, dtype=torch.float32)


def _limits(config):
    from attnplug.core.contracts import BuilderConfig

    s = config.scheduler_config
    return BuilderConfig(max_num_reqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                         max_model_len=config.model_config.max_model_len)


def test_mla_layers_the_bridge_cannot_serve_are_refused_in_vllms_layer(mla_layer):
    from attnplug.core.errors import BackendUnsupportedError

    V, config, backend, _ = mla_layer
    with pytest.raises(BackendUnsupportedError, match="sliding window") as e:
        backend.get_impl_cls()(N, L + R, 0.1, 1, None, 64, "auto", None, "decoder", None, None, L, P, R, P + R, VD,
                               None)
    assert "torch_native_mla" in str(e.value) and "vLLM" in str(e.value)
    with pytest.raises(BackendUnsupportedError, match="unquantized caches only"):
        backend.get_impl_cls()(N, L + R, 0.1, 1, None, None, "fp8", None, "decoder", None, None, L, P, R, P + R, VD,
                               None)
