"""The flash_attn builder lowers a step into FlashAttention's arguments: checked field by
field, through the emulator against torch_native (padded batches, cascade), and for the
FA3 scheduler metadata and the CUDA-graph build."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug.backends.emulators import FA3_EMULATOR, FlashAttn2EmulatedBackend, FlashAttn3EmulatedBackend
from attnplug.backends.emulators.testing import make_paged_batch, torch_native_reference
from attnplug.backends.flash_attn import FlashAttnBackend, FlashAttnMetadataBuilder
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core.contracts import AttentionCGSupport, BuilderConfig
from attnplug.core.errors import BackendUnsupportedError, MetadataError
from attnplug.runner.execute.cudagraph import PaddedMetadata


def _spec(b, window=None):
    kw = dict(block_size=b.block_size, num_kv_heads=b.num_kv_heads, head_size=b.head_size, dtype=b.key_cache.dtype)
    return SlidingWindowSpec(sliding_window=window, **kw) if window else FullAttentionSpec(**kw)


def _setup(b, backend=FlashAttn3EmulatedBackend, window=None, softcap=None, scale=None, max_reqs=8, max_len=256):
    builder = backend.get_builder_cls()(_spec(b, window), ["l0"], BuilderConfig(max_reqs, 64, max_len), "cpu")
    impl = backend.get_impl_cls()(b.num_heads, b.head_size, scale or b.head_size ** -0.5, b.num_kv_heads,
                                  sliding_window=window, logits_soft_cap=softcap)
    return builder, impl


def _forward(impl, b, md, backend=FlashAttn3EmulatedBackend, num_tokens=None):
    kv = torch.stack([b.key_cache, b.value_cache])  # the backend's [2, num_blocks, ...] layout
    n = num_tokens or b.query.shape[0]
    pad = n - b.query.shape[0]
    q, k, v = (torch.cat([t, torch.full((pad, *t.shape[1:]), -7.0)]) for t in (b.query, b.key, b.value))
    out = torch.zeros_like(q)
    impl.forward(None, q, k, v, kv, md, out)
    return out, kv


def test_fields_are_flash_attention_arguments():
    b = make_paged_batch([5, 0, 16], [1, 3, 2], block_size=4)
    builder, _ = _setup(b, window=3)
    md = builder.build(0, b.cm)
    cm = b.cm
    assert torch.equal(md.cu_seqlens_q, cm.query_start_loc) and md.cu_seqlens_q.dtype == torch.int32
    assert torch.equal(md.seqused_k, cm.seq_lens) and md.seqused_k.dtype == torch.int32
    assert md.cu_seqlens_k is None, "FA3 reads seqused_k; cu_seqlens_k is FA2's"
    for got, given in ((md.cu_seqlens_q, cm.query_start_loc), (md.seqused_k, cm.seq_lens),
                       (md.block_table, cm.block_table_tensor), (md.slot_mapping, cm.slot_mapping)):
        assert got is given, "an eager build passes the step's tensors through"
    assert (md.max_seqlen_q, md.max_seqlen_k) == (3, 18)
    assert md.window_size == (2, 0)  # W = 3 tokens -> (W - 1, 0)
    assert md.cascade is None and not md.graph
    graph = builder.build_for_cudagraph_capture(b.cm)  # persistent buffers: same addresses every step
    width = cm.block_table_tensor.shape[1]
    assert graph.block_table.shape[1] == builder.max_num_blocks_per_req and graph.graph
    assert torch.equal(graph.block_table[:, :width], cm.block_table_tensor)
    again = builder.build_for_cudagraph_capture(b.cm)
    for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "scheduler_metadata"):
        assert getattr(again, f).data_ptr() == getattr(graph, f).data_ptr(), f


@pytest.mark.parametrize("window, softcap", [(None, None), (4, 2.5)])
def test_padded_step_equals_torch_native_and_writes_no_padded_slot(window, softcap):
    b = make_paged_batch([7, 0, 3], [1, 5, 1], block_size=4, seed=2)
    builder, impl = _setup(b, window=window, softcap=softcap)
    cm = b.cm.replace(slot_mapping=torch.cat([b.cm.slot_mapping, torch.full((9,), -1)]))  # 7 real + 9 padded tokens
    padded = PaddedMetadata(8, "cpu").pad([cm], 8)[0]
    md = builder.build(0, padded)
    assert md.batch_size == 8 and md.num_reqs == 3
    assert md.cu_seqlens_q.tolist() == [0, 1, 6, 7, 7, 7, 7, 7, 7]
    assert md.seqused_k.tolist()[3:] == [0] * 5
    kv_before = torch.stack([b.key_cache, b.value_cache])
    out, kv_after = _forward(impl, b, md, num_tokens=16)
    torch.testing.assert_close(out[:7], torch_native_reference(b, None, window, softcap), atol=1e-5, rtol=1e-5)
    assert torch.equal(kv_after, kv_before)  # the real K/V were already there; padding wrote nothing


def test_cascade_fields_and_result():
    # three requests share their first 2 blocks (8 tokens); prefix is capped by the smallest
    # num_computed_tokens (9) and rounded down to whole blocks
    b = make_paged_batch([9, 12, 10], [1, 2, 3], block_size=4, seed=4, shared_prefix_blocks=2)
    builder, impl = _setup(b)
    md = builder.build(11, b.cm)
    c = md.cascade
    assert c is not None and c.common_prefix_len == 8
    assert c.cu_prefix_query_lens.tolist() == [0, 6] and c.prefix_kv_lens.tolist() == [8]
    assert c.prefix_block_table.tolist() == [b.block_ids[0][:2]]
    assert c.suffix_kv_lens.tolist() == [2, 6, 5] and c.cu_suffix_kv_lens.tolist() == [0, 2, 8, 13]
    assert c.suffix_block_table[1].tolist()[:2] == b.block_ids[1][2:4]
    out, _ = _forward(impl, b, md)
    torch.testing.assert_close(out, torch_native_reference(b), atol=1e-5, rtol=1e-5)
    assert builder.build(3, b.cm).cascade is None  # less than a block: no cascade
    wbuilder, _ = _setup(b, window=4)
    assert wbuilder.build(8, b.cm).cascade is None  # no cascade with a sliding window


def test_fa3_scheduler_metadata_uses_the_layers_parameters():
    b = make_paged_batch([5, 0], [1, 3], block_size=4)
    builder, impl = _setup(b, window=6, softcap=3.0)
    FA3_EMULATOR.calls.clear()
    md = builder.build(0, b.cm)
    name, call = FA3_EMULATOR.calls[-1]
    assert name == "get_scheduler_metadata"
    assert (call["batch_size"], call["num_heads_q"], call["num_heads_kv"], call["headdim"], call["page_size"]) == (
        2, b.num_heads, b.num_kv_heads, b.head_size, 4)
    assert call["window_size"] == (5, 0) and call["has_softcap"] is True and call["causal"] is True
    # the kernel's seqlen_k is page_table.shape[1] * page_size (flash_attn_with_kvcache takes no
    # max_seqlen_k), not the step's longest sequence: planned with 6 keys, the 6-token window
    # would be dropped (local planned as causal) while the kernel runs it local
    assert call["max_seqlen_k"] == md.block_table.shape[1] * 4 > max(5 + 1, 3)
    assert md.scheduler_metadata is not None and md.scheduler_metadata.dtype == torch.int32
    _forward(impl, b, md)
    name, call = FA3_EMULATOR.calls[-1]
    assert name == "flash_attn_with_kvcache" and call["scheduler_metadata"] is md.scheduler_metadata
    assert call["window_size"] == (5, 0) and call["softcap"] == 3.0
    del impl


def test_fa3_scheduler_metadata_sits_in_the_persistent_buffer_and_graphs_refuse_an_oversized_one(monkeypatch):
    b = make_paged_batch([5, 0], [1, 3], block_size=4)
    builder, impl = _setup(b)
    md = builder.build(0, b.cm)  # eager: FA3's own tensor, so a later build cannot overwrite it
    assert md.scheduler_metadata is not None
    assert md.scheduler_metadata.data_ptr() != builder._scheduler_metadata.data_ptr()
    graph = builder.build_for_cudagraph_capture(b.cm)  # graphs: the persistent buffer (fixed address)
    assert graph.scheduler_metadata.data_ptr() == builder._scheduler_metadata.data_ptr()
    size = builder._scheduler_metadata.shape[0]
    assert size >= 1 + 4 * 8, "room for 1 + 4 * round_up(max_num_reqs, 4) entries (FA3's largest layout)"
    big = lambda *a, **k: torch.ones(size + 1, dtype=torch.int32)  # noqa: E731
    monkeypatch.setattr(FA3_EMULATOR, "get_scheduler_metadata", big)
    eager = builder.build(0, b.cm)  # eager steps may use a fresh tensor
    assert eager.scheduler_metadata.shape[0] == size + 1
    with pytest.raises(MetadataError, match="CUDA graphs"):
        builder.build_for_cudagraph_capture(b.cm)
    del impl


def test_cudagraph_build_bakes_bounds_not_step_values():
    b = make_paged_batch([5, 0], [1, 3], block_size=4)
    builder, _ = _setup(b, max_len=64)
    md = builder.build_for_cudagraph_capture(b.cm.replace(slot_mapping=torch.cat([b.cm.slot_mapping,
                                                                                   torch.full((4,), -1)])))
    assert (md.max_seqlen_q, md.max_seqlen_k, md.cascade) == (8, 64, None)
    d = make_paged_batch([5, 6], [1, 1], block_size=4)
    assert builder.build_for_cudagraph_capture(d.cm).max_seqlen_q == 1


@pytest.mark.parametrize("graph", [False, True])
def test_update_block_table_equals_a_fresh_build(graph):
    b = make_paged_batch([5, 0, 16], [1, 3, 2], block_size=4, seed=1)
    other = make_paged_batch([5, 0, 16], [1, 3, 2], block_size=4, seed=9)  # same lengths, other blocks
    b0, _ = _setup(b, max_len=20)  # 5 blocks of 4: the steps' width (graph builds bake max_seqlen_k = 20)
    b1, _ = _setup(b, max_len=20)
    b2, _ = _setup(b, max_len=20)  # the fresh build's own buffers: b1's would overwrite what is compared
    build = (lambda builder, cm: builder.build_for_cudagraph_capture(cm)) if graph else (
        lambda builder, cm: builder.build(0, cm))
    md0 = build(b0, b.cm)
    snapshot = md0.block_table.clone()
    updated = b1.update_block_table(md0, other.cm.block_table_tensor, other.cm.slot_mapping)
    if graph:
        for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "scheduler_metadata"):
            assert getattr(updated, f).data_ptr() != getattr(md0, f).data_ptr(), f"{f}: in b1's own buffers"
        assert updated.scheduler_metadata.data_ptr() == b1._scheduler_metadata.data_ptr()
    else:
        assert updated.block_table is other.cm.block_table_tensor and updated.slot_mapping is other.cm.slot_mapping
    fresh = build(b2, other.cm)
    for f in dataclasses.fields(fresh):
        x, y = getattr(updated, f.name), getattr(fresh, f.name)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f.name
    assert torch.equal(md0.block_table, snapshot)


def test_fa2_builder_needs_pages_of_256_and_passes_cumulative_key_lengths():
    small = make_paged_batch([5], [1], block_size=16)
    with pytest.raises(MetadataError, match="multiples of 256"):
        _setup(small, backend=FlashAttn2EmulatedBackend)
    b = make_paged_batch([300, 0], [1, 20], block_size=256, num_heads=2, num_kv_heads=1, head_size=8)
    builder, impl = _setup(b, backend=FlashAttn2EmulatedBackend, max_len=512)
    assert FlashAttn2EmulatedBackend.get_builder_cls().get_cudagraph_support() is AttentionCGSupport.UNIFORM_BATCH
    assert FlashAttn3EmulatedBackend.get_builder_cls().get_cudagraph_support() is AttentionCGSupport.ALWAYS
    md = builder.build(0, b.cm)
    assert md.scheduler_metadata is None and md.cu_seqlens_k.tolist() == [0, 301, 321]
    out, _ = _forward(impl, b, md, backend=FlashAttn2EmulatedBackend)
    torch.testing.assert_close(out, torch_native_reference(b), atol=1e-5, rtol=1e-5)


def test_bad_metadata_is_rejected_before_any_copy():
    b = make_paged_batch([5, 0, 1], [1, 3, 1], block_size=4)
    builder, _ = _setup(b, max_reqs=2)
    before = builder._query_start_loc.clone()
    with pytest.raises(MetadataError, match="max_num_reqs"):
        builder.build(0, b.cm)
    with pytest.raises(MetadataError, match="int32"):
        _setup(b)[0].build(0, b.cm.replace(seq_lens=b.cm.seq_lens.long()))
    assert torch.equal(builder._query_start_loc, before)


@pytest.mark.parametrize("change, needle", [
    (dict(max_query_len=2), "max_query_len must bound"),
    (dict(seq_lens_cpu=torch.tensor([6, 2, 2], dtype=torch.int32)), "request 1: query length 3 with seq_len 2"),
])
def test_host_values_are_checked_with_validate_only(change, needle, monkeypatch):
    b = make_paged_batch([5, 0, 1], [1, 3, 1], block_size=4)
    bad = b.cm.replace(**change)
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
    _setup(b)[0].build(0, bad)  # off the hot path: no host read
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    builder = _setup(b)[0]
    before = [t.clone() for t in (builder._query_start_loc, builder._block_table, builder._slot_mapping)]
    for build in (lambda: builder.build(0, bad), lambda: builder.build_for_cudagraph_capture(bad)):
        with pytest.raises(MetadataError, match=needle):
            build()
    after = (builder._query_start_loc, builder._block_table, builder._slot_mapping)
    assert all(torch.equal(x, y) for x, y in zip(before, after)), "a failed build copied something"


def test_real_backend_without_flash_attn_says_why():
    from attnplug.backends.flash_attn.kernels import installed_kernels

    if installed_kernels() is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(BackendUnsupportedError, match="flash-attn package is not installed"):
        FlashAttnBackend.get_impl_cls()(4, 64, 0.125, 2)
    assert FlashAttnMetadataBuilder.get_cudagraph_support() is AttentionCGSupport.UNIFORM_BATCH
    spec = FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.float16)
    FlashAttnMetadataBuilder(spec, ["l0"], BuilderConfig(2, 16, 512), "cpu")  # the lowering needs no kernels


def test_fa2_single_query_gqa_step_with_padded_tokens():
    """FA2 runs single-query GQA batches with q viewed as [batch, ...] (its emulator checks
    this): an eager decode step whose tokens are padded beyond its requests passes the
    requests' rows only, and the real rows equal torch_native."""
    b = make_paged_batch([300, 17, 290], [1, 1, 1], block_size=256, num_heads=4, num_kv_heads=2, head_size=16)
    builder, impl = _setup(b, backend=FlashAttn2EmulatedBackend, max_len=512)
    padded = b.cm.replace(slot_mapping=torch.cat([b.cm.slot_mapping, torch.full((5,), -1)]))  # 8 tokens, 3 requests
    md = builder.build(0, padded)
    out, kv = _forward(impl, b, md, backend=FlashAttn2EmulatedBackend, num_tokens=8)
    torch.testing.assert_close(out[:3], torch_native_reference(b), atol=1e-5, rtol=1e-5)
    del impl


def test_a_block_id_or_slot_outside_the_cache_is_refused_before_the_write():
    """The FlashAttention kernels index the cache with the block table unchecked; on CPU
    tensors (and on a GPU with ATTNPLUG_VALIDATE=1) the impl checks them first."""
    b = make_paged_batch([5, 0, 1], [1, 3, 1], block_size=4)
    builder, impl = _setup(b)
    num_blocks = b.key_cache.shape[0]
    table = b.cm.block_table_tensor.clone()
    table[0, 0] = num_blocks + 3
    md = builder.build(0, b.cm.replace(block_table_tensor=table))
    kv = torch.stack([b.key_cache, b.value_cache])
    before = kv.clone()
    with pytest.raises(MetadataError, match=rf"block_table\[0, 0\] = {num_blocks + 3} is not a block of the cache"):
        impl.forward(None, b.query, b.key, b.value, kv, md, torch.zeros_like(b.query))
    slots = b.cm.slot_mapping.clone()
    slots[1] = num_blocks * 4 + 1
    md = builder.build(0, b.cm.replace(slot_mapping=slots))
    with pytest.raises(MetadataError, match=r"slot_mapping\[1\]"):
        impl.forward(None, b.query, b.key, b.value, kv, md, torch.zeros_like(b.query))
    assert torch.equal(kv, before), "nothing was written"
