"""The FlashAttention emulator is faithful to the documented contract: checked on the
docstring examples (bottom-right causal mask, inclusive window bounds, GQA head mapping,
all-masked rows) and against torch_native on paged batches with hand-built arguments."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.emulators import FlashAttnContractError, FlashAttnEmulator
from attnplug.backends.emulators.testing import make_paged_batch, torch_native_reference

FA2, FA3 = FlashAttnEmulator(version=2), FlashAttnEmulator(version=3)


def _visible(lq: int, lk: int, causal: bool, window=(-1, -1), page: int = 8) -> torch.Tensor:
    """Which keys each query attends to, read off the emulator: zero queries attend
    uniformly over the visible keys, and V[k] is the one-hot of k."""
    q = torch.zeros(lq, 1, lk)
    k_cache = torch.zeros(1, page, 1, lk)
    v_cache = torch.zeros(1, page, 1, lk)
    v_cache[0, :lk, 0] = torch.eye(lk)
    out = FA3.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor([lk], dtype=torch.int32),
        page_table=torch.zeros(1, 1, dtype=torch.int32), cu_seqlens_q=torch.tensor([0, lq], dtype=torch.int32),
        max_seqlen_q=lq, causal=causal, window_size=window)
    return (out[:, 0] > 0).int()


def test_bottom_right_causal_mask_matches_the_docstring_examples():
    assert _visible(2, 5, causal=True).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # "If the row of the mask is all zero, the output will be zero."
    assert _visible(5, 2, causal=True).tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]


def test_window_bounds_are_inclusive_and_bottom_right_aligned():
    # query i sees keys [i + Lk - Lq - left, i + Lk - Lq + right]
    assert _visible(3, 6, causal=False, window=(1, 1)).tolist() == [
        [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]]
    # a W-token window is (W - 1, 0): W = 2 keys per query, the query's own included
    assert _visible(4, 4, causal=True, window=(1, 0)).tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_gqa_query_heads_share_kv_heads_in_blocks():
    # 6 query heads over 2 KV heads: heads 0-2 read KV head 0, heads 3-5 KV head 1
    v_cache = torch.zeros(1, 8, 2, 2)
    v_cache[0, 0, 0] = torch.tensor([1.0, 0.0])
    v_cache[0, 0, 1] = torch.tensor([0.0, 1.0])
    out = FA3.flash_attn_with_kvcache(
        torch.zeros(1, 6, 2), torch.zeros_like(v_cache), v_cache, cache_seqlens=torch.tensor([1], dtype=torch.int32),
        page_table=torch.zeros(1, 1, dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        max_seqlen_q=1, causal=True)
    assert out[0, :, 1].tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("window, softcap", [(None, None), (3, None), (None, 2.0), (5, 3.0)])
def test_paged_varlen_equals_torch_native(window, softcap):
    b = make_paged_batch([5, 0, 16, 9], [1, 7, 3, 1], block_size=4, num_heads=4, num_kv_heads=2, seed=3)
    cm = b.cm
    scale = 0.7
    expected = torch_native_reference(b, scale, window, softcap)
    fa_window = (-1, -1) if window is None else (window - 1, 0)
    out3 = FA3.flash_attn_with_kvcache(
        b.query, b.key_cache, b.value_cache, cache_seqlens=cm.seq_lens, page_table=cm.block_table_tensor,
        cu_seqlens_q=cm.query_start_loc, max_seqlen_q=cm.max_query_len, softmax_scale=scale, causal=True,
        window_size=fa_window, softcap=softcap or 0.0)
    torch.testing.assert_close(out3, expected, atol=1e-5, rtol=1e-5)
    # FA2 passes key lengths as cu_seqlens_k and needs pages of 256: same math over one big page each
    cu_k = torch.zeros(cm.num_reqs + 1, dtype=torch.int32)
    cu_k[1:] = torch.cumsum(cm.seq_lens, 0)
    with pytest.raises(FlashAttnContractError, match="multiple of 256"):
        FA2.flash_attn_varlen_func(b.query, b.key_cache, b.value_cache, cm.query_start_loc, cu_k, cm.max_query_len,
                                   cm.max_seq_len, softmax_scale=scale, causal=True, window_size=fa_window,
                                   block_table=cm.block_table_tensor)


def test_fa2_paged_varlen_with_256_token_pages_equals_torch_native():
    b = make_paged_batch([300, 0, 2], [1, 40, 3], block_size=256, num_heads=2, num_kv_heads=1, head_size=8, seed=5)
    cm = b.cm
    cu_k = torch.zeros(cm.num_reqs + 1, dtype=torch.int32)
    cu_k[1:] = torch.cumsum(cm.seq_lens, 0)
    out, lse, _ = FA2.flash_attn_varlen_func(
        b.query, b.key_cache, b.value_cache, cm.query_start_loc, cu_k, cm.max_query_len, cm.max_seq_len,
        causal=True, block_table=cm.block_table_tensor, return_attn_probs=True)
    torch.testing.assert_close(out, torch_native_reference(b), atol=1e-5, rtol=1e-5)
    assert lse.shape == (2, cm.num_actual_tokens) and torch.isfinite(lse).all()


def test_contract_violations_are_reported():
    b = make_paged_batch([3], [2], block_size=4)
    cm = b.cm
    kw = dict(cache_seqlens=cm.seq_lens, page_table=cm.block_table_tensor, cu_seqlens_q=cm.query_start_loc,
              max_seqlen_q=cm.max_query_len, causal=True)
    with pytest.raises(FlashAttnContractError, match="int32"):
        FA3.flash_attn_with_kvcache(b.query, b.key_cache, b.value_cache, **{**kw, "cache_seqlens": cm.seq_lens.long()})
    with pytest.raises(FlashAttnContractError, match="max_seqlen_q"):
        FA3.flash_attn_with_kvcache(b.query, b.key_cache, b.value_cache, **{**kw, "max_seqlen_q": 1})
    with pytest.raises(FlashAttnContractError, match="exceed the block table"):
        FA3.flash_attn_with_kvcache(b.query, b.key_cache, b.value_cache,
                                    **{**kw, "cache_seqlens": cm.seq_lens + 100})
    with pytest.raises(FlashAttnContractError, match="window_size"):
        FA3.flash_attn_with_kvcache(b.query, b.key_cache, b.value_cache, **{**kw, "window_size": (-2, 0)})


def test_fa3_checks_the_schedule_was_planned_for_the_call():
    """FA3's plan and run share normalised arguments; the emulator refuses metadata planned
    with another seqlen_k (found by reading hopper/flash_api.cpp: flash_attn_with_kvcache's
    seqlen_k is page_table.shape[1] * page_size)."""
    from attnplug.backends.emulators.flash_attn_kernels import FlashAttnEmulator, fa3_plan

    b = make_paged_batch([5, 0], [1, 3], block_size=4, num_heads=4, num_kv_heads=2, head_size=16)
    fa3 = FlashAttnEmulator(version=3)
    width = b.cm.block_table_tensor.shape[1]
    kw = dict(batch_size=2, max_seqlen_q=3, num_heads_q=4, num_heads_kv=2, headdim=16, cache_seqlens=b.cm.seq_lens,
              cu_seqlens_q=b.cm.query_start_loc, page_size=4, causal=True, window_size=(5, 0))
    call = dict(cache_seqlens=b.cm.seq_lens, page_table=b.cm.block_table_tensor, cu_seqlens_q=b.cm.query_start_loc,
                max_seqlen_q=3, causal=True, window_size=(5, 0))
    good = fa3.get_scheduler_metadata(max_seqlen_k=width * 4, **kw)
    fa3.flash_attn_with_kvcache(b.query, b.key_cache, b.value_cache, scheduler_metadata=good, **call)
    stale = fa3.get_scheduler_metadata(max_seqlen_k=6, **kw)  # the step's longest sequence
    assert stale.shape[0] != good.shape[0], "planned causal (window dropped) vs run local: other layouts"
    with pytest.raises(FlashAttnContractError, match="was planned for"):
        fa3.flash_attn_with_kvcache(b.query, b.key_cache, b.value_cache, scheduler_metadata=stale, **call)
    assert fa3_plan(1, 1, 64, 4, 2, 16, 4, True, (-1, -1), False)[1] == 1 + 4 * 4  # causal: 4 rows per 4 requests
    assert fa3_plan(1, 1, 64, 4, 2, 16, 4, True, (70, 0), False)[0][7:9] == (True, False), "window past seqlen_k"
