"""``--kv-cache-dtype fp8_e4m3|fp8_e5m2`` in the runner: 1-byte pages (more blocks in the same
memory), scales calibrated once from the first batch, and a parity run that measures the
agreement with HF's fp32 cache instead of demanding identity."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnplug.cache_groups.specs import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
from attnplug.runner.commands.kv_cache_setup import blocks_for_memory, quantized_specs
from attnplug.runner.models.kv_scales import FIRST_BATCH_HEADROOM, calibrate_once


def test_fp8_pages_hold_twice_the_blocks_of_bf16_in_the_same_memory():
    specs = {"a": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16),
             "b": SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                    sliding_window=8),
             "m": MLAAttentionSpec(block_size=16, kv_lora_rank=32, qk_rope_head_dim=16, dtype=torch.bfloat16)}
    fp8 = quantized_specs(specs, torch.float8_e4m3fn)
    assert fp8["a"].dtype == fp8["b"].dtype == torch.float8_e4m3fn and fp8["m"].dtype == torch.bfloat16
    assert fp8["a"].page_size_bytes * 2 == specs["a"].page_size_bytes == 2 * 16 * 2 * 64 * 2
    assert quantized_specs(specs, None) is specs
    blocks = [blocks_for_memory([s[k] for k in "ab"], [3, 3], 4) for s in (specs, fp8)]
    assert blocks[1] >= 1.9 * blocks[0], blocks


def test_first_batch_calibration_sets_per_head_scales_once():
    layer = SimpleNamespace(kv_scales_pending=True, kv_cache_dtype=torch.float8_e4m3fn,
                            k_scale=torch.ones(2), v_scale=torch.ones(()))
    k = torch.zeros(3, 2, 4)
    k[1, 0, 2], k[2, 1, 0] = -896.0, 44.8
    v = torch.full((3, 2, 4), 4.48)
    calibrate_once(layer, k, v)
    want_k = torch.tensor([2.0, 0.1]) * FIRST_BATCH_HEADROOM
    assert torch.allclose(layer.k_scale, want_k) and torch.allclose(layer.v_scale, 0.01 * torch.tensor(FIRST_BATCH_HEADROOM))
    calibrate_once(layer, k * 100, v * 100)  # frozen: the second batch changes nothing
    assert torch.allclose(layer.k_scale, want_k) and not layer.kv_scales_pending


def _run(kv_cache_dtype: str):
    from attnplug.runner.commands.assemble import build_engine
    from attnplug.runner.step.scheduler_output import SamplingParams

    args = SimpleNamespace(model="tiny-llama", backend="torch_native", block_size=16, seed=0, max_model_len=64,
                           max_num_seqs=2, max_num_batched_tokens=32, num_blocks=None,
                           kv_cache_dtype=kv_cache_dtype, kv_scales="first_batch", device="cpu")
    setup = build_engine(args, requests=False)
    for i, n in enumerate((9, 20)):
        setup.engine.add_request(f"r{i}", list(range(3, 3 + n)), SamplingParams(temperature=0.0, max_tokens=2))
    return setup, setup.engine.run()


def test_an_fp8_run_stores_one_byte_per_element_with_calibrated_scales():
    setup, results = _run("fp8_e4m3")
    caches = setup.engine.runner.kv_caches
    assert {c.dtype for c in caches.values()} == {torch.float8_e4m3fn}
    layers = [m for m in setup.model.modules() if hasattr(m, "kv_scales_pending")]
    assert layers and all(not m.kv_scales_pending and m.k_scale.shape == (m.num_kv_heads,) for m in layers)
    assert all((m.k_scale != 1.0).all() and (m.v_scale != 1.0).all() for m in layers)  # calibrated, not unit
    assert setup.kv_cache == {"dtype": "fp8_e4m3", "scales": "first_batch", "granularity": "per KV head"}
    assert all(len(r.output_token_ids) == 2 for r in results.values())


@pytest.mark.slow
def test_smollm2_fp8_cache_agrees_with_the_fp32_cache():
    """Real weights (docs/real-weights.md): SmolLM2's greedy tokens with an fp8_e4m3 cache
    vs HF's fp32 cache (``attnplug parity --model smollm2 --kv-cache-dtype fp8_e4m3``)."""
    pytest.importorskip("transformers")
    from attnplug.runner.commands.parity_real import run_real_parity

    res = run_real_parity("smollm2", num_requests=4, max_tokens=64, kv_cache_dtype="fp8_e4m3")
    assert res.ok and res.kv_cache["token_agreement"] >= 0.4, res.line()  # measured 97/167 (58%)
    assert 0 < res.kv_cache["mean_abs_dlogit"] < 1.0, res.line()


def test_selection_refuses_a_backend_without_fp8_with_the_reason():
    from attnplug.core.contracts import AttentionLayerConfig
    from attnplug.core.errors import AttnplugError
    from attnplug.runner.commands.assemble import resolve_backend

    cfg = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float16,
                               kv_cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(AttnplugError, match="kv_cache_dtype fp8_e4m3 not supported \\(supported: auto\\)"):
        resolve_backend("flash_attn", {"l0": cfg}, {"l0": "full_attention"})
    assert resolve_backend("torch_native", {"l0": cfg}, {"l0": "full_attention"})["l0"].get_name() == "torch_native"
