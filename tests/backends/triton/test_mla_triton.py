"""The triton_mla backend in the Triton interpreter: the split-KV decode kernel against the
torch_native_mla reference, and the MLA conformance checks (the full family is slow)."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.mla.torch_native.backend import TorchNativeMLABackend
from attnplug.backends.mla.triton.backend import TritonMLABackend
from attnplug.backends.mla.triton.builder import kv_splits_for
from attnplug.backends.mla.triton.decode import mla_decode
from attnplug.core.mla import MLADecodeMetadata, MLALayerConfig
from attnplug.plugins.conformance import mla_checks
from attnplug.plugins.conformance.mla_cases import MLA_CASES
from attnplug.plugins.conformance.mla_harness import MLAStep


@pytest.mark.parametrize("dtype, splits", [(torch.float32, 1), (torch.float32, 4), (torch.float16, 2)])
def test_decode_kernel_matches_reference_with_poisoned_tail(dtype, splits):
    g = torch.Generator().manual_seed(3)
    lr, rope, heads, bs = 40, 8, 3, 16                      # not powers of two: masked loads
    seq = torch.tensor([1, 17, 50], dtype=torch.int32)
    cache = torch.full((12, bs, lr + rope), float("nan"), dtype=dtype)
    table = torch.tensor([[5, 0, 0, 0], [2, 9, 0, 0], [11, 1, 7, 4]], dtype=torch.int32)
    for r, n in enumerate(seq.tolist()):
        for p in range(n):
            cache[table[r, p // bs], p % bs] = torch.randn(lr + rope, generator=g).to(dtype)
    q = torch.randn(3, heads, lr + rope, generator=g).to(dtype)
    o, lse = mla_decode(q, cache, table, seq, kv_lora_rank=lr, scale=0.3, num_kv_splits=splits)
    ref_impl = TorchNativeMLABackend.get_impl_cls()(MLALayerConfig(heads, lr, 16, rope, 16, dtype=dtype), 0.3)
    want_o, want_lse = ref_impl.forward_mqa(q, cache, MLADecodeMetadata(3, table, seq, 50))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o.float(), want_o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)


def test_split_count_follows_the_longest_context():
    assert [kv_splits_for(n) for n in (1, 32, 33, 64, 96, 128, 10_000)] == [1, 1, 2, 2, 2, 4, 8]


@pytest.mark.parametrize("name", ["mixed", "chunked_context", "padded_rows"])
def test_triton_mla_cases_match_the_reference(name):
    step = MLAStep(TritonMLABackend, next(c for c in MLA_CASES if c.name == name), "cpu")
    run = step.run()
    assert mla_checks.check_outputs(step, run) == [] and mla_checks.check_cache(run) == []


def test_triton_mla_absorbed_decode_equals_expanded_prefill():
    assert mla_checks.check_absorbed_equals_expanded(TritonMLABackend, "cpu") == []


@pytest.mark.slow
def test_attnplug_check_passes_on_triton_mla(capsys):
    from attnplug.runner.commands.check import main

    rc = main(["triton_mla", "--device", "cpu", "-k", "mla"])
    out = capsys.readouterr().out
    assert rc == 0 and " passed" in out and "failed" not in out, out


def test_deepseek_v2_parity_with_hf_on_triton_mla():
    pytest.importorskip("transformers")
    from attnplug.runner.commands.parity import run_parity

    cfg = {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 128,
           "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
           "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "initializer_range": 0.1}
    res = run_parity(cfg, num_requests=3, seed=1, max_num_batched_tokens=16, max_tokens=4, block_size=16,
                     backend="triton_mla", force_preemption=True)
    assert res.ok and res.preemptions > 0, res.line()
