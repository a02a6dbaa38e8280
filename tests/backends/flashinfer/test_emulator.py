"""The FlashInfer emulator is faithful to the documented contract: the KV length formula
``page_size * (num_pages - 1) + last_page_len``, inclusive ``window_left``, decode vs
causal prefill, plan/run checks, CUDA-graph buffers; and it equals torch_native on a
mixed batch with hand-built arguments."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.emulators import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    FlashInferContractError,
)
from attnplug.backends.emulators.testing import make_paged_batch, torch_native_reference

I32 = torch.int32
WS = torch.zeros(8, dtype=torch.uint8)


def _t(values):
    return torch.tensor(values, dtype=I32)


def _one_hot_cache(num_pages: int, page_size: int, positions: dict[tuple[int, int], int], width: int):
    """V at (page, offset) is the one-hot of ``positions[(page, offset)]``; K is zero."""
    cache = torch.zeros(num_pages, 2, page_size, 1, width)
    for (page, off), k in positions.items():
        cache[page, 1, off, 0, k] = 1.0
    return cache


def test_kv_length_is_page_size_times_full_pages_plus_last_page_len():
    # pages [3, 7, 2] of 4 tokens, last page holding 2: 4 * 2 + 2 = 10 keys, in page order
    order = [(3, o) for o in range(4)] + [(7, o) for o in range(4)] + [(2, o) for o in range(4)]
    cache = _one_hot_cache(8, 4, {pg: k for k, pg in enumerate(order)}, 12)
    w = BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    w.plan(_t([0, 3]), _t([3, 7, 2]), _t([2]), 1, 1, 12, 4, q_data_type=torch.float32)
    out = w.run(torch.zeros(1, 1, 12), cache)
    seen = (out[0, 0] > 0).int().tolist()
    assert seen == [1] * 10 + [0, 0]  # keys 10 and 11 (the rest of the last page) unseen
    # window_left is inclusive: the decode query at p = 9 with window_left = 2 sees 7, 8, 9
    w.plan(_t([0, 3]), _t([3, 7, 2]), _t([2]), 1, 1, 12, 4, window_left=2, q_data_type=torch.float32)
    assert (w.run(torch.zeros(1, 1, 12), cache)[0, 0] > 0).int().tolist() == [0] * 7 + [1, 1, 1, 0, 0]


def test_prefill_is_causal_bottom_right_and_windowed():
    # one request: 6 keys on pages [1, 0] of 4 (last_page_len 2), 3 queries at positions 3, 4, 5
    cache = _one_hot_cache(2, 4, {(1, 0): 0, (1, 1): 1, (1, 2): 2, (1, 3): 3, (0, 0): 4, (0, 1): 5}, 6)
    w = BatchPrefillWithPagedKVCacheWrapper(WS, "NHD")
    w.plan(_t([0, 3]), _t([0, 2]), _t([1, 0]), _t([2]), 1, 1, 6, 4, causal=True, q_data_type=torch.float32)
    assert (w.run(torch.zeros(3, 1, 6), cache)[:, 0] > 0).int().tolist() == [
        [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    w.plan(_t([0, 3]), _t([0, 2]), _t([1, 0]), _t([2]), 1, 1, 6, 4, causal=True, window_left=1,
           q_data_type=torch.float32)
    assert (w.run(torch.zeros(3, 1, 6), cache)[:, 0] > 0).int().tolist() == [
        [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("window, softcap", [(None, None), (4, None), (None, 3.0), (6, 2.0)])
def test_decode_and_prefill_wrappers_equal_torch_native(window, softcap):
    # decodes first, then prefills (FlashInfer's split); pages are the torch_native blocks
    b = make_paged_batch([7, 12, 0, 5], [1, 1, 6, 9], block_size=4, num_heads=4, num_kv_heads=2, seed=11)
    scale, W = 0.6, window
    expected = torch_native_reference(b, scale, W, softcap)
    cache = torch.stack([b.key_cache, b.value_cache], dim=1)
    lens = b.cm.seq_lens.tolist()
    pages = [blocks[: -(-n // 4)] for blocks, n in zip(b.block_ids, lens)]
    last = [(n - 1) % 4 + 1 for n in lens]
    wl = -1 if W is None else W - 1
    dec = BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    dec.plan(_t([0, len(pages[0]), len(pages[0]) + len(pages[1])]), _t(pages[0] + pages[1]), _t(last[:2]), 4, 2, 16,
             4, window_left=wl, logits_soft_cap=softcap, q_data_type=torch.float32, sm_scale=scale)
    pre = BatchPrefillWithPagedKVCacheWrapper(WS, "NHD")
    pre.plan(_t([0, 6, 15]), _t([0, len(pages[2]), len(pages[2]) + len(pages[3])]), _t(pages[2] + pages[3]),
             _t(last[2:]), 4, 2, 16, 4, causal=True, sm_scale=scale, window_left=wl, logits_soft_cap=softcap,
             q_data_type=torch.float32)
    out = torch.empty_like(b.query)
    dec.run(b.query[:2], cache, out=out[:2])
    pre.run(b.query[2:], cache, out=out[2:])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # HND layout and a (k, v) tuple read the same keys
    hnd = BatchDecodeWithPagedKVCacheWrapper(WS, "HND")
    hnd.plan(_t([0, len(pages[0])]), _t(pages[0]), _t(last[:1]), 4, 2, 16, 4, window_left=wl,
             logits_soft_cap=softcap, q_data_type=torch.float32, sm_scale=scale)
    got = hnd.run(b.query[:1], (b.key_cache.transpose(1, 2), b.value_cache.transpose(1, 2)))
    torch.testing.assert_close(got, expected[:1], atol=1e-5, rtol=1e-5)


def test_cuda_graph_mode_copies_the_plan_into_the_fixed_buffers():
    indptr, indices, last = torch.zeros(3, dtype=I32), torch.zeros(8, dtype=I32), torch.ones(2, dtype=I32)
    w = BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
                                           paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
    w.plan(_t([0, 2, 2]), _t([5, 6]), _t([3, 4]), 2, 1, 8, 4, q_data_type=torch.float32)
    assert indptr.tolist() == [0, 2, 2] and indices[:2].tolist() == [5, 6] and last.tolist() == [3, 4]
    with pytest.raises(FlashInferContractError, match="batch size should be fixed"):
        w.plan(_t([0, 1]), _t([5]), _t([3]), 2, 1, 8, 4, q_data_type=torch.float32)


def test_contract_violations_are_reported():
    w = BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    with pytest.raises(FlashInferContractError, match="before plan"):
        w.run(torch.zeros(1, 1, 8), torch.zeros(2, 2, 4, 1, 8))
    with pytest.raises(FlashInferContractError, match="last_page_len"):
        w.plan(_t([0, 1]), _t([1]), _t([5]), 1, 1, 8, 4)
    with pytest.raises(FlashInferContractError, match="int32"):
        w.plan(_t([0, 1]).long(), _t([1]), _t([1]), 1, 1, 8, 4)
    w.plan(_t([0, 1]), _t([1]), _t([4]), 1, 1, 8, 4, q_data_type=torch.float16)
    with pytest.raises(FlashInferContractError, match="dtypes"):
        w.run(torch.zeros(1, 1, 8), torch.zeros(2, 2, 4, 1, 8))
    with pytest.raises(FlashInferContractError, match="kv_layout"):
        BatchDecodeWithPagedKVCacheWrapper(WS, "NDH")


def test_the_emulated_wrappers_take_flashinfer_0_6_18s_keywords_only():
    """No catch-all **kwargs: a misspelt keyword, or the decode wrapper's buffer names given to
    the prefill wrapper, fails on the CPU as it would on a GPU."""
    from attnplug.backends.emulators.flashinfer_kernels import (BatchDecodeWithPagedKVCacheWrapper,
                                                                BatchPrefillWithPagedKVCacheWrapper)

    ws = torch.zeros(16, dtype=torch.uint8)
    buf = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(TypeError):
        BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=buf)
    decode = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    indptr, indices, last = (torch.tensor(x, dtype=torch.int32) for x in ([0, 1], [1], [3]))
    with pytest.raises(TypeError):
        decode.plan(indptr, indices, last, 4, 1, 16, 4, window_lft=3)
    with pytest.raises(FlashInferContractError, match="Unsupported group_size: 16"):
        BatchDecodeWithPagedKVCacheWrapper(ws, "NHD").plan(indptr, indices, last, 16, 1, 16, 4)
    BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True).plan(indptr, indices, last, 16, 1, 16, 4)
