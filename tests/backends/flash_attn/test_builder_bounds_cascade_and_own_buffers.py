"""The flash_attn builder at its edges (mutation-testing survivors, issue 23): the kernels
it finds installed, block size 1 (a one-token cascade), a single request, the graph
build's query bound, every cascade tensor's dtype, and ``update_block_table`` carrying a
cascade, FA2's ``cu_seqlens_k`` and the scheduler metadata into its own buffers."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch

import attnplug.backends.flash_attn.builder as builder_module
import attnplug.backends.flash_attn.kernels as kernels_module
from attnplug.backends.emulators import FA3_EMULATOR, FlashAttn2EmulatedBackend, FlashAttn3EmulatedBackend
from attnplug.backends.emulators.testing import make_paged_batch, torch_native_reference
from attnplug.backends.flash_attn import FlashAttnMetadataBuilder
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core.contracts import AttentionCGSupport, BuilderConfig
from attnplug.core.errors import BackendUnsupportedError, MetadataError

sys.path.insert(0, str(Path(__file__).parent))
from test_cascade_clamp import _forward  # noqa: E402  (one forward helper for the builder's tests)


def _setup(b, backend=FlashAttn3EmulatedBackend, max_reqs=8, max_len=256, block_size=None):
    spec = FullAttentionSpec(block_size=block_size or b.block_size, num_kv_heads=b.num_kv_heads,
                             head_size=b.head_size, dtype=b.key_cache.dtype)
    builder = backend.get_builder_cls()(spec, ["l0"], BuilderConfig(max_reqs, 64, max_len), "cpu")
    impl = backend.get_impl_cls()(b.num_heads, b.head_size, b.head_size ** -0.5, b.num_kv_heads)
    return builder, impl


def _same(x, y, name):
    if isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            _same(getattr(x, f.name), getattr(y, f.name), f"{name}.{f.name}")
    else:
        assert x == y, name


def test_kernels_come_from_the_installed_flash_attn(monkeypatch):
    monkeypatch.setattr(builder_module, "installed_kernels", lambda: None)
    monkeypatch.setattr(kernels_module, "unavailable_reason", lambda: "flash_attn 9.9 failed to import")
    with pytest.raises(BackendUnsupportedError) as e:
        FlashAttnMetadataBuilder.load_kernels()
    assert e.value.backend_name == "flash_attn" and e.value.reasons == ["flash_attn 9.9 failed to import"]
    assert "cannot serve for FlashAttnMetadataBuilder" in str(e.value)
    monkeypatch.setattr(kernels_module, "unavailable_reason", lambda: None)
    with pytest.raises(BackendUnsupportedError) as e:
        FlashAttnMetadataBuilder.load_kernels()
    assert e.value.reasons == ["flash-attn unavailable"]
    assert FlashAttnMetadataBuilder.kernels_version() == 2
    assert FlashAttnMetadataBuilder.get_cudagraph_support() is AttentionCGSupport.UNIFORM_BATCH
    fa3 = FA3_EMULATOR.kernels()  # what an installed FlashAttention 3 looks like to the builder
    monkeypatch.setattr(builder_module, "installed_kernels", lambda: fa3)
    assert FlashAttnMetadataBuilder.load_kernels() is fa3
    assert FlashAttnMetadataBuilder.kernels_version() == 3
    assert FlashAttnMetadataBuilder.get_cudagraph_support() is AttentionCGSupport.ALWAYS


@pytest.mark.parametrize("limits", [(0, 64, 256), (8, 0, 256), (8, 64, 0), (-1, 64, 256)])
def test_non_positive_limits_are_refused(limits):
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16, dtype=torch.float32)
    with pytest.raises(MetadataError, match=r"FlashAttnMetadataBuilder: BuilderConfig limits must be positive"):
        FlashAttn3EmulatedBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(*limits), "cpu")


def test_one_token_blocks_cascade_a_one_token_prefix_and_graphs_never_cascade():
    b = make_paged_batch([1, 3, 2], [1, 2, 1], block_size=1, seed=3, shared_prefix_blocks=1)
    builder, impl = _setup(b)
    md = builder.build(1, b.cm)
    c = md.cascade
    assert c is not None and c.common_prefix_len == 1 and c.max_suffix_kv_len == 4
    assert c.suffix_kv_lens.tolist() == [1, 4, 2] and c.prefix_block_table.tolist() == [b.block_ids[0][:1]]
    torch.testing.assert_close(_forward(impl, b, md), torch_native_reference(b), atol=1e-5, rtol=1e-5)
    assert builder.build(5, b.cm).cascade.common_prefix_len == 1  # clamped to request 0's one token
    graph = builder.build_for_cudagraph_capture(b.cm)
    assert graph.cascade is None and graph.scheduler_metadata is not None


def test_a_single_request_cascades_and_every_cascade_tensor_is_int32():
    b = make_paged_batch([9], [3], block_size=4, seed=8, shared_prefix_blocks=2)
    builder, impl = _setup(b)
    md = builder.build(8, b.cm)
    c = md.cascade
    assert c is not None and c.common_prefix_len == 8 and c.max_suffix_kv_len == 4
    assert c.cu_prefix_query_lens.tolist() == [0, 3] and c.cu_prefix_kv_lens.tolist() == [0, 8]
    assert c.suffix_kv_lens.tolist() == [4] and c.cu_suffix_kv_lens.tolist() == [0, 4]
    for f in dataclasses.fields(c):
        t = getattr(c, f.name)
        if isinstance(t, torch.Tensor):
            assert t.dtype == torch.int32 and t.device == torch.device("cpu"), f.name
    assert md.scheduler_metadata is None, "a cascade step plans its kernels itself"
    torch.testing.assert_close(_forward(impl, b, md), torch_native_reference(b), atol=1e-5, rtol=1e-5)


def test_graph_build_query_bound_is_the_padded_token_count_unless_every_query_is_one_token():
    b = make_paged_batch([5, 3], [2, 2], block_size=4)  # max_query_len 2: not a decode batch
    builder, _ = _setup(b)
    cm = b.cm.replace(slot_mapping=torch.cat([b.cm.slot_mapping, torch.full((3,), -1)]))
    md = builder.build_for_cudagraph_capture(cm)
    assert (md.max_seqlen_q, md.max_seqlen_k, md.num_actual_tokens, md.num_reqs) == (7, 256, 4, 2)
    assert md.slot_mapping.tolist() == cm.slot_mapping.tolist() and md.graph


def test_scheduler_metadata_is_planned_for_the_steps_tensors_and_dtype(monkeypatch):
    b = make_paged_batch([5, 0, 2], [1, 3, 2], block_size=4, dtype=torch.float16)
    builder, impl = _setup(b)
    original, seen = FA3_EMULATOR.get_scheduler_metadata, {}

    def recording(**kw):
        seen.update(kw)
        return original(**kw)

    monkeypatch.setattr(FA3_EMULATOR, "get_scheduler_metadata", recording)
    md = builder.build(0, b.cm)
    assert seen["qkv_dtype"] is torch.float16 and seen["max_seqlen_q"] == 3 and seen["batch_size"] == 3
    assert seen["cu_seqlens_q"] is md.query_start_loc and seen["cache_seqlens"] is md.seq_lens
    assert builder.build(0, b.cm, fast_build=True).scheduler_metadata is None
    del impl


def test_scheduler_metadata_of_exactly_the_buffers_size_sits_in_it(monkeypatch):
    b = make_paged_batch([5, 0], [1, 3], block_size=4)
    builder, impl = _setup(b)
    size = builder._scheduler_metadata.shape[0]
    exact = torch.arange(size, dtype=torch.int32)
    monkeypatch.setattr(FA3_EMULATOR, "get_scheduler_metadata", lambda **kw: exact.clone())
    md = builder.build_for_cudagraph_capture(b.cm)
    assert md.scheduler_metadata.data_ptr() == builder._scheduler_metadata.data_ptr()
    assert torch.equal(md.scheduler_metadata, exact)
    monkeypatch.setattr(FA3_EMULATOR, "get_scheduler_metadata", lambda **kw: torch.ones(size + 1, dtype=torch.int32))
    with pytest.raises(MetadataError, match=rf"has {size + 1} entries, more than the persistent buffer's {size}: "
                                            r".*run without graphs or report the version$"):
        builder.build_for_cudagraph_capture(b.cm)
    del impl


def test_update_block_table_refuses_another_block_size_and_cuts_a_taller_table():
    b = make_paged_batch([5, 0, 16], [1, 3, 2], block_size=4, seed=1)
    b0, _ = _setup(b)
    b8, _ = _setup(b, block_size=8)
    md = b0.build(0, b.cm)
    with pytest.raises(MetadataError, match="metadata has block_size 4, this builder 8: only groups with the same"):
        b8.update_block_table(md, b.cm.block_table_tensor, b.cm.slot_mapping)
    taller = torch.cat([b.cm.block_table_tensor, torch.zeros_like(b.cm.block_table_tensor)])
    updated = b0.update_block_table(md, taller, b.cm.slot_mapping)
    assert updated.block_table.shape == (3, taller.shape[1]) and torch.equal(updated.block_table, b.cm.block_table_tensor)


def test_update_block_table_recomputes_the_cascade_for_the_other_table():
    b = make_paged_batch([9, 12, 10], [1, 2, 3], block_size=4, seed=4, shared_prefix_blocks=2)
    other = make_paged_batch([9, 12, 10], [1, 2, 3], block_size=4, seed=11, shared_prefix_blocks=2)
    b0, impl = _setup(b)
    b1, _ = _setup(b)
    md = b0.build(11, b.cm)
    updated = b1.update_block_table(md, other.cm.block_table_tensor, other.cm.slot_mapping)
    fresh = _setup(b)[0].build(11, other.cm)
    assert updated.cascade is not None and updated.cascade.common_prefix_len == 8
    _same(updated.cascade, fresh.cascade, "cascade")
    assert updated.cascade.prefix_block_table.tolist() == [other.block_ids[0][:2]]
    torch.testing.assert_close(_forward(impl, other, updated), torch_native_reference(other), atol=1e-5, rtol=1e-5)


def test_graph_update_block_table_copies_fa2_cumulative_lengths_and_refuses_oversized_plans():
    b = make_paged_batch([300, 0], [1, 20], block_size=256, num_heads=2, num_kv_heads=1, head_size=8, seed=1)
    other = make_paged_batch([300, 0], [1, 20], block_size=256, num_heads=2, num_kv_heads=1, head_size=8, seed=2)
    b0, _ = _setup(b, backend=FlashAttn2EmulatedBackend, max_len=512)
    b1, _ = _setup(b, backend=FlashAttn2EmulatedBackend, max_len=512)
    md = b0.build_for_cudagraph_capture(b.cm)
    updated = b1.update_block_table(md, other.cm.block_table_tensor, other.cm.slot_mapping)
    assert updated.cu_seqlens_k.tolist() == [0, 301, 321]
    assert updated.cu_seqlens_k.data_ptr() == b1._cu_seqlens_k.data_ptr()
    assert updated.seq_lens.tolist() == [301, 20] and updated.seq_lens.data_ptr() == b1._seq_lens.data_ptr()
    assert updated.block_table[:, :2].tolist() == other.cm.block_table_tensor[:, :2].tolist()
    f3 = make_paged_batch([5, 0], [1, 3], block_size=4)
    g0, impl = _setup(f3, max_len=8)  # the table's 2 columns: a graph build's max_seq_len is max_model_len
    g1, _ = _setup(f3, max_len=8)
    graph = g0.build_for_cudagraph_capture(f3.cm)
    size = g1._scheduler_metadata.shape[0]
    oversized = dataclasses.replace(graph, scheduler_metadata=torch.ones(size + 1, dtype=torch.int32))
    with pytest.raises(MetadataError, match="cannot be used with CUDA graphs"):
        g1.update_block_table(oversized, f3.cm.block_table_tensor, f3.cm.slot_mapping)
    del impl


def test_cascade_edges_every_query_empty_and_no_real_request():
    b = make_paged_batch([8, 8], [0, 0], block_size=4, seed=2, shared_prefix_blocks=2)  # every key is prefix
    builder, _ = _setup(b)
    c = builder.build(8, b.cm).cascade
    assert c is not None and c.max_suffix_kv_len == 0 and c.suffix_kv_lens.tolist() == [0, 0]
    assert c.cu_prefix_query_lens.tolist() == [0, 0]
    one = make_paged_batch([8], [0], block_size=4, shared_prefix_blocks=2)
    zero = torch.zeros(1, dtype=torch.int32)
    padded_only = one.cm.replace(num_reqs=0, num_actual_tokens=0, max_seq_len=0, seq_lens=zero, seq_lens_cpu=zero,
                                 num_computed_tokens_cpu=zero)  # one padded row, no real request
    md = builder.build(8, padded_only)
    assert md.cascade is None and (md.batch_size, md.num_reqs) == (1, 0)


@pytest.mark.parametrize("backend, block", [(FlashAttn3EmulatedBackend, 4), (FlashAttn2EmulatedBackend, 256)])
def test_graph_build_at_capacity_fills_int32_buffers(backend, block):
    """``max_num_reqs`` requests exactly (every buffer's last row used); the persistent
    tensors keep FlashAttention's dtypes."""
    b = make_paged_batch([5, 0, 300], [1, 3, 2], block_size=block, num_heads=2, num_kv_heads=1, head_size=8, seed=5)
    builder, impl = _setup(b, backend=backend, max_reqs=3, max_len=2 * block if block == 256 else 320)
    md = builder.build_for_cudagraph_capture(b.cm)
    assert md.query_start_loc.tolist() == [0, 1, 4, 6] and md.seq_lens.tolist() == [6, 3, 302]
    for f in ("query_start_loc", "seq_lens", "block_table"):
        assert getattr(md, f).dtype == torch.int32, f
    assert md.slot_mapping.dtype == torch.int64 and md.slot_mapping.tolist() == b.cm.slot_mapping.tolist()
    live = b.cm.block_table_tensor.shape[1]
    assert torch.equal(md.block_table[:, :live], b.cm.block_table_tensor)
    if block == 256:
        assert md.cu_seqlens_k.tolist() == [0, 6, 9, 311] and md.cu_seqlens_k.dtype == torch.int32
    del impl


def test_eager_build_cuts_longer_step_tensors_to_the_batch():
    """The step compiler may hand views longer than ``B`` (its persistent buffers): the
    kernels get ``B`` rows."""
    b = make_paged_batch([5, 0, 7], [1, 3, 2], block_size=4, seed=6)
    builder, impl = _setup(b)
    cm = b.cm
    longer = cm.replace(seq_lens=torch.cat([cm.seq_lens, torch.tensor([9, 9], dtype=torch.int32)]),
                        block_table_tensor=torch.cat([cm.block_table_tensor, cm.block_table_tensor[:2]]))
    md = builder.build(0, longer)
    assert md.seq_lens.tolist() == [6, 3, 9] and torch.equal(md.block_table, cm.block_table_tensor)
    torch.testing.assert_close(_forward(impl, b, md), torch_native_reference(b), atol=1e-5, rtol=1e-5)


def test_a_single_request_capacity_is_enough():
    b = make_paged_batch([5], [2], block_size=4)
    builder, _ = _setup(b, max_reqs=1)
    assert builder.build(0, b.cm).seq_lens.tolist() == [7]


@pytest.mark.parametrize("max_reqs", [1, 5, 8, 400])
def test_scheduler_metadata_buffer_holds_fa3s_largest_layout(max_reqs):
    """FA3's ``get_scheduler_metadata`` returns up to ``1 + 4 * round_up(batch, 4)`` int32:
    a graph build of a full batch must find it room."""
    b = make_paged_batch([5], [2], block_size=4)
    builder, _ = _setup(b, max_reqs=max_reqs)
    largest = torch.arange(1 + 4 * 4 * -(-max_reqs // 4), dtype=torch.int32)
    kept = builder._keep_scheduler_metadata(largest, graph=True)
    assert kept.data_ptr() == builder._scheduler_metadata.data_ptr() and torch.equal(kept, largest)


def test_refusals_name_the_builder_the_counts_and_the_limit(monkeypatch):
    b = make_paged_batch([5, 0, 1], [1, 3, 1], block_size=4)
    with pytest.raises(MetadataError, match=re.escape(
            "query_start_loc has 4 entries for num_reqs=3: need num_reqs + 1 <= entries <= "
            "BuilderConfig.max_num_reqs + 1 = 3 (padded requests included); raise max_num_reqs or "
            "pass query_start_loc[:num_reqs + 1].")):
        _setup(b, max_reqs=2)[0].build(0, b.cm)
    wide = b.cm.replace(seq_lens=b.cm.seq_lens.long())
    for validate in (None, "1"):
        if validate:
            monkeypatch.setenv("ATTNPLUG_VALIDATE", validate)
        else:
            monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
        with pytest.raises(MetadataError, match="the flash_attn builder needs torch.int32"):
            _setup(b)[0].build(0, wide)
    long = b.cm.replace(seq_lens_cpu=torch.tensor([6, 3, 300], dtype=torch.int32), max_seq_len=300)
    with pytest.raises(MetadataError, match="a seq_len of 300 exceeds BuilderConfig.max_model_len=256"):
        _setup(b)[0].build(0, long)
