"""The kernel emulators read fp8 caches by their libraries' documented scale conventions:
FA3's ``q_descale / k_descale / v_descale`` (``[batch_size, num_heads_k]``, real = stored *
descale, fp8 e4m3 q/k/v, bfloat16 out) and FlashInfer's per-tensor ``k_scale / v_scale``
(python floats: ``sm_scale * k_scale`` on the logits, ``out * v_scale``). Each equals
torch_native over the dequantised cache, and ignoring the scales would not."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug.backends.emulators import (
    BatchDecodeWithPagedKVCacheWrapper,
    FlashAttnContractError,
    FlashAttnEmulator,
)
from attnplug.backends.emulators.testing import make_paged_batch, torch_native_reference

E4M3 = torch.float8_e4m3fn


def _fp8(x: torch.Tensor, descale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stored fp8, dequantised float32)`` of ``x`` ``[..., heads, d]`` with per-head ``descale``."""
    stored = (x / descale.view(-1, 1)).to(E4M3)
    return stored, stored.float() * descale.view(-1, 1)


def _dequantised_batch(b, **changes):
    """``b`` with its caches (and the step's K/V, which torch_native writes) replaced."""
    slots = b.cm.slot_mapping.long()
    kc, vc = changes["key_cache"], changes["value_cache"]
    return dataclasses.replace(b, key=kc.flatten(0, 1)[slots], value=vc.flatten(0, 1)[slots], **changes)


def test_fa3_descales_are_per_request_and_kv_head():
    b = make_paged_batch([6, 0, 9], [1, 5, 2], block_size=8, num_heads=4, num_kv_heads=2, seed=3)
    kd, vd, qd = torch.tensor([0.01, 0.02]), torch.tensor([0.01, 0.003]), torch.tensor([0.01, 0.03])
    q8, q_real = _fp8(b.query, qd.repeat_interleave(2))
    k8, k_real = _fp8(b.key_cache, kd)
    v8, v_real = _fp8(b.value_cache, vd)
    expected = torch_native_reference(_dequantised_batch(b, query=q_real, key_cache=k_real, value_cache=v_real))
    B = b.cm.num_reqs
    kw = dict(cache_seqlens=b.cm.seq_lens, page_table=b.cm.block_table_tensor, cu_seqlens_q=b.cm.query_start_loc,
              max_seqlen_q=b.cm.max_query_len, causal=True)
    fa3 = FlashAttnEmulator(version=3)
    out = fa3.flash_attn_with_kvcache(q8, k8, v8, q_descale=qd.expand(B, 2), k_descale=kd.expand(B, 2),
                                      v_descale=vd.expand(B, 2), **kw)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    ignored = fa3.flash_attn_with_kvcache(q8, k8, v8, **kw)  # descale 1.0: far off
    assert (ignored.float() - expected).abs().max() > 1.0
    with pytest.raises(FlashAttnContractError, match="float8_e4m3fn q / k / v only"):
        fa3.flash_attn_with_kvcache(b.query, b.key_cache, b.value_cache, k_descale=kd.expand(B, 2), **kw)


def test_flashinfer_k_scale_v_scale_are_per_tensor_floats():
    b = make_paged_batch([7, 12], [1, 1], block_size=4, num_heads=4, num_kv_heads=2, seed=5)
    ks, vs = 0.01, 0.004
    k8, k_real = _fp8(b.key_cache, torch.tensor([ks, ks]))
    v8, v_real = _fp8(b.value_cache, torch.tensor([vs, vs]))
    expected = torch_native_reference(_dequantised_batch(b, key_cache=k_real, value_cache=v_real))
    lens = b.cm.seq_lens.tolist()
    pages = [blocks[: -(-n // 4)] for blocks, n in zip(b.block_ids, lens)]
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    dec = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8), "NHD")
    dec.plan(t([0, len(pages[0]), len(pages[0]) + len(pages[1])]), t(pages[0] + pages[1]),
             t([(n - 1) % 4 + 1 for n in lens]), 4, 2, 16, 4, q_data_type=torch.float32, kv_data_type=E4M3)
    cache = torch.stack([k8, v8], dim=1)
    torch.testing.assert_close(dec.run(b.query, cache, k_scale=ks, v_scale=vs), expected, atol=1e-5, rtol=1e-5)
    assert (dec.run(b.query, cache) - expected).abs().max() > 1.0  # without the scales: far off
    with pytest.raises(Exception, match="python float"):
        dec.run(b.query, cache, k_scale=torch.tensor(ks))
