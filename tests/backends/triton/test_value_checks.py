"""Bad slots, block ids and lengths reach no Triton kernel: a clear ``MetadataError`` and an
unchanged cache (``backends/common/value_checks.py``; CPU tensors are always checked, a GPU
with ``ATTNPLUG_VALIDATE=1``). Found by a user trial: a slot past the cache used to be
written outside the cache tensor."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.triton import TritonBackend, compute_slot_mapping, paged_attention, write_kv_cache
from attnplug.backends.common import value_checks
from attnplug.backends.triton import cache_ops
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core import BuilderConfig, CommonAttentionMetadata
from attnplug.core.errors import MetadataError


def _layer(block_ids, slot_mapping=None, dtype=torch.float32):
    """A 3-block cache that is a view into an 8-block buffer (writes past it would land there)."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=dtype)
    builder = TritonBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(2, 16, 64), "cpu")
    cm = CommonAttentionMetadata.from_lengths([0, 3], [3, 1], block_ids, block_size=16)
    if slot_mapping is not None:
        cm = cm.replace(slot_mapping=torch.tensor(slot_mapping))
    impl = TritonBackend.get_impl_cls()(2, 16, 0.25, 1)
    backing = torch.zeros(TritonBackend.get_kv_cache_shape(8, 16, 1, 16), dtype=dtype)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, h, 16, generator=g).to(dtype) for h in (2, 1, 1))
    return impl, builder.build(0, cm), backing, q, k, v


@pytest.mark.parametrize("block_ids, slots, message", [
    ([[1, 0, 0], [2, 0, 0]], [16, 17, 18, 16 * 5 + 3], r"slot_mapping\[3\] = 83 is outside the cache's 48 slots"),
    ([[1, 0, 0], [9, 0, 0]], None, r"outside the cache's 48 slots"),
    ([[1, 0, 0], [2, 0, 0]], [16, -7, 18, 32], r"slot_mapping\[1\] = -7"),
])
def test_out_of_range_slots_raise_and_write_nothing(block_ids, slots, message):
    impl, md, backing, q, k, v = _layer(block_ids, slots)
    out = torch.zeros_like(q)
    with pytest.raises(MetadataError, match=message):
        impl.forward(None, q, k, v, backing[:3], md, out)
    assert not backing.any() and not out.any(), "nothing written, inside or outside the cache"


def test_a_block_id_past_the_cache_in_the_table_raises_before_the_write():
    # slots are fine (request 1 writes in block 2) but request 0's keys sit in block 7
    impl, md, backing, q, k, v = _layer([[7, 0, 0], [2, 0, 0]], [16 * 2 + 0, 16 * 2 + 1, 16 * 2 + 2, 16 * 2 + 3])
    with pytest.raises(MetadataError, match=r"block_table\[0, 0\] = 7 is not a block of the cache"):
        impl.forward(None, q, k, v, backing[:3], md, torch.zeros_like(q))
    assert not backing.any()


def test_bfloat16_is_refused_under_the_interpreter():
    impl, md, backing, q, k, v = _layer([[1, 0, 0], [2, 0, 0]], dtype=torch.bfloat16)
    with pytest.raises(MetadataError, match="bfloat16 under TRITON_INTERPRET=1"):
        impl.forward(None, q, k, v, backing, md, torch.zeros_like(q))
    assert not backing.any()


def _batch(**over):
    g = torch.Generator().manual_seed(1)
    kw = dict(query=torch.randn(4, 2, 16, generator=g), key_cache=torch.randn(4, 16, 1, 16, generator=g),
              value_cache=torch.randn(4, 16, 1, 16, generator=g), output=torch.zeros(4, 2, 16),
              query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
              seq_lens=torch.tensor([3, 20], dtype=torch.int32),
              block_table=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32), num_reqs=2, max_query_len=3, scale=0.25)
    kw.update(over)
    return kw


@pytest.mark.parametrize("over, message", [
    (dict(block_table=torch.tensor([[1], [2]], dtype=torch.int32)), "block_table is 1 blocks wide"),
    (dict(seq_lens=torch.tensor([2, 20], dtype=torch.int32)), "request 0: seq_len 2 < query_len 3"),
    (dict(block_table=torch.tensor([[1, 0], [2, 4]], dtype=torch.int32)), r"block_table\[1, 1\] = 4"),
    (dict(query_start_loc=torch.tensor([0, 3, 9], dtype=torch.int32)), "end at most at num_tokens = 4"),
    (dict(num_reqs=3), "num_reqs 3 needs query_start_loc"),
    (dict(sliding_window=0), "sliding_window must be a positive"),
    (dict(logits_soft_cap=0.0), "logits_soft_cap must be positive"),
    (dict(query=torch.randn(4, 2, 20), output=torch.zeros(4, 2, 20), key_cache=torch.randn(4, 16, 1, 20),
          value_cache=torch.randn(4, 16, 1, 20)), "head_size 20 is not a multiple of 16"),
    (dict(seq_lens=torch.tensor([3, 20])), "must be int32"),
])
def test_paged_attention_refuses_inconsistent_batches(over, message):
    kw = _batch(**over)
    with pytest.raises(MetadataError, match=message):
        paged_attention(**kw)
    assert not kw["output"].any()


def test_paged_attention_accepts_the_unused_part_of_the_table():
    # request 0 needs one block: whatever column 1 holds is never read, so it is not checked
    kw = _batch(block_table=torch.tensor([[1, 99], [2, 3]], dtype=torch.int32))
    assert paged_attention(**kw).abs().sum() > 0


def test_slot_mapping_checks_and_never_writes_past_the_padded_length(monkeypatch):
    qsl = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    pos = torch.tensor([5, 0, 1, 2, 8, 9])
    bt = torch.tensor([[1, 2, 0], [5, 0, 0], [3, 7, 4]], dtype=torch.int32)
    out = torch.full((8,), 1234)
    with pytest.raises(MetadataError, match="6 real tokens, more than num_tokens_padded = 4"):
        compute_slot_mapping(qsl, pos, bt, 4, out, num_reqs=3, num_tokens_padded=4)
    with pytest.raises(MetadataError, match=r"a position outside \[0, 12\)"):
        compute_slot_mapping(qsl, torch.tensor([5, 0, 1, 2, 8, 12]), bt, 4, out, num_reqs=3)
    assert (out == 1234).all(), "a refused call writes nothing"
    monkeypatch.setattr(cache_ops, "values_checked", lambda device: False)  # as on a GPU without validation
    view = compute_slot_mapping(qsl, pos, bt, 4, out, num_reqs=3, num_tokens_padded=4)
    assert view.tolist() == [9, 20, 21, 22] and out[4:].tolist() == [1234] * 4, "the kernel stops at the view"


def test_write_kv_cache_wants_int64_slots():
    cache = torch.zeros(2, 16, 1, 16)
    with pytest.raises(MetadataError, match="int64 slot_mapping"):
        write_kv_cache(torch.ones(1, 1, 16), torch.ones(1, 1, 16), cache, cache.clone(),
                       torch.tensor([3], dtype=torch.int32))
    assert not cache.any()


def test_when_values_are_checked(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(value_checks.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(value_checks.torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
    assert value_checks.values_checked(torch.device("cpu")) and not value_checks.values_checked(cuda)
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    assert value_checks.values_checked(cuda)
    monkeypatch.setattr(value_checks.torch.cuda, "get_sync_debug_mode", lambda: 2)
    assert not value_checks.values_checked(cuda), "the conformance suite's no-sync proof takes precedence"
    monkeypatch.setattr(value_checks.torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(value_checks.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not value_checks.values_checked(cuda), "no host read while a CUDA graph is captured"
