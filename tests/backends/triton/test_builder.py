"""TritonMetadataBuilder (zero-copy eager builds, persistent buffers for graphs, CUDA graphs ALWAYS, update_block_table, split-KV
decision, validation) and TritonAttentionImpl.forward's checks."""

from __future__ import annotations

import doctest

import pytest
import torch

import attnplug.backends.triton.impl as impl_mod
from attnplug.backends.triton import SplitKVPolicy, TritonAttentionMetadata, TritonBackend, TritonMetadataBuilder
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import AttentionCGSupport, BuilderConfig
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32)
CFG = BuilderConfig(max_num_reqs=4, max_num_batched_tokens=64, max_model_len=128)


def _cm(computed, scheduled, table, pad=0):
    cm = CommonAttentionMetadata.from_lengths(computed, scheduled, table, block_size=16)
    if pad:
        cm = cm.replace(slot_mapping=torch.cat([cm.slot_mapping, torch.full((pad,), PAD_SLOT_ID)]))
    return cm


def test_declares_cuda_graphs_always_and_block_table_updates():
    assert TritonMetadataBuilder.get_cudagraph_support() == AttentionCGSupport.ALWAYS
    assert TritonMetadataBuilder.supports_update_block_table and TritonMetadataBuilder.reorder_batch_threshold is None
    assert TritonBackend.get_builder_cls() is TritonMetadataBuilder


def test_eager_builds_pass_the_step_tensors_through():
    b = TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu")
    cm = _cm([6, 7, 0], [1, 1, 20], [[1, 0], [2, 3], [4, 5]], pad=4)
    m = b.build(0, cm)
    for got, given in ((m.query_start_loc, cm.query_start_loc), (m.seq_lens, cm.seq_lens),
                       (m.block_table_tensor, cm.block_table_tensor), (m.slot_mapping, cm.slot_mapping)):
        assert got is given, "an eager build copies nothing"
    assert m.query_start_loc.tolist() == [0, 1, 2, 22] and m.seq_lens.tolist() == [7, 8, 20]
    assert m.slot_mapping.shape == (26,) and m.slot_mapping[-4:].tolist() == [PAD_SLOT_ID] * 4
    assert (m.num_reqs, m.num_actual_tokens, m.max_query_len, m.max_seq_len) == (3, 22, 20, 20)
    assert m.num_kv_splits == 1 and not m.use_split_kv and not m.graph
    padded = cm.replace(query_start_loc=torch.tensor([0, 1, 2, 22, 22], dtype=torch.int32))
    assert b.build(0, padded).query_start_loc.tolist() == [0, 1, 2, 22], "the real rows only"


def test_graph_builds_live_in_persistent_buffers_across_steps():
    b = TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu")
    m1 = b.build_for_cudagraph_capture(_cm([5, 0], [1, 7], [[1, 0], [2, 3]]))
    ptrs = [t.data_ptr() for t in (m1.query_start_loc, m1.seq_lens, m1.block_table_tensor, m1.slot_mapping)]
    m2 = b.build_for_cudagraph_capture(_cm([6, 7, 0], [1, 1, 20], [[1, 0], [2, 3], [4, 5]], pad=4))
    assert [t.data_ptr() for t in (m2.query_start_loc, m2.seq_lens, m2.block_table_tensor, m2.slot_mapping)] == ptrs
    assert m2.graph and m2.query_start_loc.tolist() == [0, 1, 2, 22] and m2.seq_lens.tolist() == [7, 8, 20]
    assert m2.block_table_tensor.shape == (3, b.max_num_blocks_per_req), "the whole persistent width"
    assert m2.block_table_tensor[:, :2].tolist() == [[1, 0], [2, 3], [4, 5]]


def test_graph_builds_copy_only_the_live_block_table_columns():
    b = TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu")
    table = torch.arange(1, 17, dtype=torch.int32).reshape(2, 8)  # 8 columns, 2 live (max_seq_len 20)
    b.build_for_cudagraph_capture(_cm([5, 12], [1, 8], table))
    assert b._block_table[:2].tolist() == [[1, 2, 0, 0, 0, 0, 0, 0], [9, 10, 0, 0, 0, 0, 0, 0]]


def test_update_block_table_passes_through_eagerly_and_copies_for_graphs():
    b0, b1 = (TritonMetadataBuilder(SPEC, [f"l{g}"], CFG, "cpu") for g in range(2))
    cm0 = _cm([5, 0], [1, 7], [[1, 0], [2, 3]])
    cm1 = cm0.replace(block_table_tensor=torch.tensor([[6, 0], [7, 8]], dtype=torch.int32),
                      slot_mapping=torch.tensor([101, 112, 113, 114, 115, 116, 117, 118]))
    m0 = b0.build(0, cm0)
    m1 = b1.update_block_table(m0, cm1.block_table_tensor, cm1.slot_mapping)
    assert m1.block_table_tensor is cm1.block_table_tensor and m1.slot_mapping is cm1.slot_mapping
    assert m0.block_table_tensor is cm0.block_table_tensor, "the source is not mutated"
    g0 = b0.build_for_cudagraph_capture(cm0)
    before = [t.clone() for t in (g0.block_table_tensor, g0.slot_mapping)]
    g1 = b1.update_block_table(g0, cm1.block_table_tensor, cm1.slot_mapping)
    assert torch.equal(g0.block_table_tensor, before[0]) and torch.equal(g0.slot_mapping, before[1])
    assert g1.block_table_tensor.data_ptr() == b1._block_table.data_ptr()
    assert g1.query_start_loc.data_ptr() == b1._query_start_loc.data_ptr()
    assert g1.slot_mapping.data_ptr() == b1._slot_mapping.data_ptr()
    fresh = b1.build_for_cudagraph_capture(cm1)
    for f in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
        assert torch.equal(getattr(g1, f), getattr(fresh, f)), f
        eager, graph = getattr(m1, f), getattr(fresh, f)
        if eager.dim() == 2:  # max_seq_len 7: one live column (the others are never read)
            eager, graph = eager[:, :1], graph[:, :1]
        assert torch.equal(eager, graph), f
    assert (g1.num_reqs, g1.max_seq_len, g1.num_kv_splits) == (fresh.num_reqs, fresh.max_seq_len, fresh.num_kv_splits)


STRUCTURE = [
    (dict(num_reqs=5), "exceed BuilderConfig.max_num_reqs|num_reqs=5"),  # graph builds: rows from query_start_loc
    (dict(slot_mapping=torch.zeros(65, dtype=torch.int64)), "max_num_batched_tokens=64"),
    (dict(slot_mapping=torch.zeros(3, dtype=torch.int64)), "need >= num_actual_tokens=8"),
    (dict(block_table_tensor=torch.ones(2, 2, dtype=torch.int64)), "needs int32"),
    (dict(seq_lens=torch.tensor([10, 7])), "seq_lens is torch.int64"),
    (dict(max_seq_len=200), "needs 13 blocks"),
]
VALUES = [
    (dict(num_actual_tokens=9), "they must agree"),
    (dict(max_query_len=3), "max_query_len must bound"),
    (dict(max_seq_len=5), "max_seq_len must bound"),
    (dict(seq_lens_cpu=torch.tensor([10, 3], dtype=torch.int32)), "request 1: query length 7 with seq_len 3"),
]


@pytest.mark.parametrize("change, needle", STRUCTURE + VALUES)
@pytest.mark.parametrize("graph", [False, True])
def test_bad_metadata_raises_and_changes_nothing(change, needle, graph, monkeypatch):
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")  # the host values too
    b = TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu")
    good = b.build_for_cudagraph_capture(_cm([5, 0], [1, 7], [[1, 0], [2, 3]]))
    snapshot = [t.clone() for t in (b._query_start_loc, b._seq_lens, b._block_table, b._slot_mapping)]
    cm = _cm([9, 0], [1, 7], [[4, 0], [5, 6]]).replace(**change)
    with pytest.raises(MetadataError, match=needle):
        b.build_for_cudagraph_capture(cm) if graph else b.build(0, cm)
    after = [b._query_start_loc, b._seq_lens, b._block_table, b._slot_mapping]
    assert all(torch.equal(x, y) for x, y in zip(snapshot, after)), "a failed build copied something"
    assert good.seq_lens.tolist() == [6, 7]


@pytest.mark.parametrize("change, needle", STRUCTURE)
def test_structure_is_checked_without_validate(change, needle, monkeypatch):
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
    b = TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu")
    with pytest.raises(MetadataError, match=needle):
        b.build(0, _cm([9, 0], [1, 7], [[4, 0], [5, 6]]).replace(**change))


def test_host_values_are_checked_only_with_validate(monkeypatch):
    """Off the hot path: without ATTNPLUG_VALIDATE=1 a build reads no host tensor, so host
    values that disagree pass the builder (the impls still check the index values they use)."""
    bad = _cm([9, 0], [1, 7], [[4, 0], [5, 6]]).replace(max_query_len=3)
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
    assert TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu").build(0, bad).max_query_len == 3
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    with pytest.raises(MetadataError, match="max_query_len must bound"):
        TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu").build(0, bad)


def test_builder_needs_a_kernel_block_size():
    with pytest.raises(MetadataError, match="kernels page by \\[16, 32, 64\\]"):
        TritonMetadataBuilder(FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=32), ["l"], CFG, "cpu")


def test_split_kv_policy():
    p = SplitKVPolicy()
    kw = dict(num_kv_heads=8, num_sms=132)
    assert p.num_kv_splits(num_reqs=1, max_query_len=1, max_seq_len=8192, **kw) == 16
    assert p.num_kv_splits(num_reqs=8, max_query_len=1, max_seq_len=8192, **kw) == 8
    assert p.num_kv_splits(num_reqs=1, max_query_len=1, max_seq_len=1024, **kw) == 4, "segments of >= 256 keys"
    assert p.num_kv_splits(num_reqs=1, max_query_len=1, max_seq_len=1000, **kw) == 1, "short contexts: unified"
    assert p.num_kv_splits(num_reqs=1, max_query_len=2, max_seq_len=8192, **kw) == 1, "prefill present: unified"
    assert p.num_kv_splits(num_reqs=0, max_query_len=0, max_seq_len=0, **kw) == 1


def test_split_kv_is_one_from_the_saturating_request_count():
    for p in (SplitKVPolicy(), SplitKVPolicy(max_query_len=1 << 30, min_seq_len=1, min_tokens_per_split=8, max_splits=4)):
        for kv_heads in (1, 2, 8, 12):
            for sms in (1, 8, 132):
                sat = p.saturating_num_reqs(kv_heads, sms)
                for n in (sat, sat + 1, 3 * sat):
                    assert p.num_kv_splits(n, kv_heads, 1, 1 << 20, sms) == 1, (kv_heads, sms, n)
                if sat > 1 and p.max_splits > 1:  # the smallest such count: one fewer request splits
                    assert p.num_kv_splits(sat - 1, kv_heads, 1, 1 << 20, sms) > 1, (kv_heads, sms)


def test_builder_takes_the_split_path_for_long_decodes():
    cfg = BuilderConfig(max_num_reqs=2, max_num_batched_tokens=8, max_model_len=4096)
    b = TritonMetadataBuilder(SPEC, ["l0"], cfg, "cpu")
    table = [list(range(1, 257)), list(range(257, 513))]
    md = b.build(0, _cm([4000, 3000], [1, 1], table))
    assert md.use_split_kv and md.num_kv_splits == 8  # 4001 // 256 = 15 segments at most, rounded down
    assert not b.build(0, _cm([4000, 3000], [1, 5], table)).use_split_kv


def _impl_inputs():
    b = TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu")
    md = b.build(0, _cm([0, 3], [3, 1], [[1, 0], [2, 0]]))
    impl = TritonBackend.get_impl_cls()(4, 32, 32 ** -0.5, 2)
    kv = torch.zeros(TritonBackend.get_kv_cache_shape(3, 16, 2, 32))
    q, k, v = torch.randn(4, 4, 32), torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    return impl, md, kv, q, k, v


def test_forward_writes_the_cache_and_matches_torch_native():
    from attnplug.backends.torch_native import TorchNativeBackend

    impl, md, kv, q, k, v = _impl_inputs()
    out = impl.forward(None, q, k, v, kv, md, torch.zeros_like(q))
    tn_builder = TorchNativeBackend.get_builder_cls()(SPEC, ["l0"], CFG, "cpu")
    tn_md = tn_builder.build(0, _cm([0, 3], [3, 1], [[1, 0], [2, 0]]))
    kv_ref = torch.zeros_like(kv)
    ref = TorchNativeBackend.get_impl_cls()(4, 32, 32 ** -0.5, 2).forward(None, q, k, v, kv_ref, tn_md,
                                                                         torch.zeros_like(q))
    assert torch.allclose(out, ref, atol=1e-5) and torch.equal(kv, kv_ref)


@pytest.mark.parametrize("bad, needle", [
    ("metadata", "not TritonAttentionMetadata"),
    ("dtype", "dtypes differ"),
    ("cache_shape", "kv_cache (3, 2, 16, 1, 32) should be"),
    ("rows", "fewer rows than num_actual_tokens=4"),
])
def test_forward_rejects_inconsistent_inputs(bad, needle):
    impl, md, kv, q, k, v = _impl_inputs()
    if bad == "metadata":
        md = object()
    elif bad == "dtype":
        q = q.half()
    elif bad == "cache_shape":
        kv = torch.zeros(3, 2, 16, 1, 32)
    elif bad == "rows":
        q, k, v = q[:2], k[:2], v[:2]
    with pytest.raises(MetadataError, match=needle.replace("(", "\\(").replace(")", "\\)")):
        impl.forward(None, q, k, v, kv, md, torch.zeros_like(q))


def test_impl_doctest():
    assert doctest.testmod(impl_mod).failed == 0


def test_metadata_type_is_exported():
    assert TritonAttentionMetadata.__module__ == "attnplug.backends.triton.metadata"


def test_cuda_graph_builds_use_the_padded_request_count_and_match_eager():
    """The runner pads a graph step (empty-query requests, seq_len 0, null rows, PAD slots);
    ``build_for_cudagraph_capture`` bakes the padded count, and the real tokens' output and
    cache writes equal an eager build's."""
    from attnplug.runner.execute.cudagraph import PaddedMetadata

    cm = _cm([5, 0, 20], [1, 7, 2], [[1, 0], [2, 3], [4, 5]], pad=6)  # 10 real tokens padded to 16
    (padded,) = PaddedMetadata(4, "cpu").pad([cm], 4)
    b = TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu")
    g = b.build_for_cudagraph_capture(padded)
    assert (g.num_reqs, g.num_actual_tokens) == (4, 10) and g.query_start_loc.tolist() == [0, 1, 8, 10, 10]
    impl = TritonBackend.get_impl_cls()(4, 32, 32 ** -0.5, 2)
    q, k, v = torch.randn(16, 4, 32), torch.randn(16, 2, 32), torch.randn(16, 2, 32)
    kv_graph, kv_eager = (torch.zeros(TritonBackend.get_kv_cache_shape(6, 16, 2, 32)) for _ in range(2))
    out_graph = impl.forward(None, q, k, v, kv_graph, g, torch.zeros_like(q))
    eager = TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu").build(0, cm)
    out_eager = impl.forward(None, q, k, v, kv_eager, eager, torch.zeros_like(q))
    assert torch.equal(out_graph, out_eager) and torch.equal(kv_graph, kv_eager)
    assert not out_graph[10:].any(), "padded tokens are not written"
