"""The torch_native builder's own contract, found by mutation testing (docs/mutation-testing.md):
every metadata field it passes through, the cascade path (a shared prefix > 0, full
attention only), the all-decode fast path and its conditions, the refusals word for word
with their bounds (a table exactly at capacity is fine), and its decode constants sized
from the config. Each compares with the dense reference where it runs the kernel."""

from __future__ import annotations

import types

import pytest
import torch

from attnplug.backends.emulators.testing import make_paged_batch, torch_native_reference
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core.contracts import BuilderConfig
from attnplug.core.errors import MetadataError

BLOCK = 4


def setup(b, window: int | None = None, max_reqs: int = 8):
    kw = dict(block_size=BLOCK, num_kv_heads=b.num_kv_heads, head_size=b.head_size, dtype=b.key_cache.dtype)
    spec = FullAttentionSpec(**kw) if window is None else SlidingWindowSpec(sliding_window=window, **kw)
    builder = TorchNativeBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(max_reqs, 64, 256), "cpu")
    impl = TorchNativeBackend.get_impl_cls()(b.num_heads, b.head_size, b.head_size ** -0.5, b.num_kv_heads,
                                             sliding_window=window)
    return builder, impl


def forward(impl, b, md):
    kv = torch.stack([b.key_cache, b.value_cache], dim=1)  # torch_native: [num_blocks, 2, B, H, D]
    out = torch.zeros_like(b.query)
    impl.forward(None, b.query, b.key, b.value, kv, md, out)
    return out


@pytest.mark.parametrize("computed, scheduled", [([5, 9, 0], [1, 1, 1]), ([5, 0, 3], [1, 6, 2])],
                         ids=["all-decode", "mixed"])
def test_every_field_is_the_steps_own(computed, scheduled):
    b = make_paged_batch(computed, scheduled, block_size=BLOCK, seed=1)
    builder, impl = setup(b)
    cm = b.cm
    md = builder.build(0, cm)
    assert (md.num_reqs, md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (
        cm.num_reqs, cm.num_actual_tokens, cm.max_query_len, cm.max_seq_len)
    assert md.block_size == BLOCK and md.sliding_window is None and md.causal == cm.causal
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
        assert getattr(md, name) is getattr(cm, name), name
    assert md.write_slots.tolist() == cm.slot_mapping[:cm.num_actual_tokens].tolist()
    assert getattr(md, "cascade", None) is None
    torch.testing.assert_close(forward(impl, b, md), torch_native_reference(b), atol=1e-5, rtol=1e-5)


def test_a_shared_prefix_runs_the_cascade_and_matches_the_reference():
    b = make_paged_batch([12, 9, 10], [1, 2, 3], block_size=BLOCK, seed=5, shared_prefix_blocks=2)
    builder, impl = setup(b)
    md = builder.build(8, b.cm)
    assert md.cascade is not None and md.cascade.common_prefix_len == 8
    torch.testing.assert_close(forward(impl, b, md), torch_native_reference(b), atol=1e-5, rtol=1e-5)
    plain = builder.build(0, b.cm)
    assert getattr(plain, "cascade", None) is None
    for asked in (1, 3):  # under one block: rounded down to nothing shared, no cascade
        md = builder.build(asked, b.cm)
        assert getattr(md, "cascade", None) is None or md.cascade.common_prefix_len == 0
        torch.testing.assert_close(forward(impl, b, md), torch_native_reference(b), atol=1e-5, rtol=1e-5)


def test_a_window_never_cascades():
    b = make_paged_batch([12, 9, 10], [1, 2, 3], block_size=BLOCK, seed=5, shared_prefix_blocks=2)
    builder, _ = setup(b, window=6)
    md = builder.build(8, b.cm)
    assert getattr(md, "cascade", None) is None and md.sliding_window == 6


@pytest.mark.parametrize("computed, scheduled, one_segment", [
    ([5, 9], [1, 1], True),    # every row decodes: one segment for all
    ([5, 9], [1, 2], False),   # a two-token query: decode + prefill segments
    ([5, 0], [1, 1], True),
])
def test_the_all_decode_path_only_for_single_token_rows(computed, scheduled, one_segment):
    b = make_paged_batch(computed, scheduled, block_size=BLOCK, seed=3)
    builder, impl = setup(b)
    md = builder.build(0, b.cm)
    assert (len(md.segments) == 1) is one_segment
    torch.testing.assert_close(forward(impl, b, md), torch_native_reference(b), atol=1e-5, rtol=1e-5)


def test_refusals_word_for_word_and_the_exact_capacity():
    b = make_paged_batch([5, 6], [1, 2], block_size=BLOCK, seed=2)  # seq_lens 6, 8: two blocks each
    builder, _ = setup(b)
    cm = b.cm
    builder.build(0, cm)  # max_seq_len 8 == 2 blocks x 4: exactly at capacity
    short = cm.block_table_tensor[:, :1]
    with pytest.raises(MetadataError) as e:
        builder.build(0, types.SimpleNamespace(**{**vars(cm), "block_table_tensor": short}))
    assert str(e.value) == ("block_table_tensor has 1 blocks of 4 tokens per row (4 tokens) but max_seq_len=8: the "
                            "keys would be unaddressable; allocate enough blocks per request (or check the block "
                            "size).")
    with pytest.raises(MetadataError) as e:
        builder.build(0, types.SimpleNamespace(**{**vars(cm), "block_table_tensor": cm.block_table_tensor[:1]}))
    assert str(e.value) == ("block_table_tensor has shape (1, 2) but num_reqs=2: torch_native needs one row per "
                            "request; pass [num_reqs, max_num_blocks_per_req].")
    with pytest.raises(MetadataError) as e:
        builder.build(0, types.SimpleNamespace(**{**vars(cm), "block_table_tensor": cm.block_table_tensor[0]}))
    assert "block_table_tensor has shape (2,)" in str(e.value)
    with pytest.raises(MetadataError) as e:
        builder.build(0, types.SimpleNamespace(**{**vars(cm), "query_start_loc_cpu": cm.query_start_loc_cpu[:2]}))
    assert str(e.value) == ("query_start_loc_cpu has 2 entries and seq_lens_cpu 2 but num_reqs=2: expected >= "
                            "num_reqs + 1 and >= num_reqs.")
    with pytest.raises(MetadataError) as e:
        builder.build(0, types.SimpleNamespace(**{**vars(cm), "seq_lens_cpu": cm.seq_lens_cpu[:1]}))
    assert "seq_lens_cpu 1 but num_reqs=2" in str(e.value)
    with pytest.raises(MetadataError) as e:
        builder.build(0, types.SimpleNamespace(**{**vars(cm), "slot_mapping": cm.slot_mapping[:2]}))
    assert str(e.value) == "slot_mapping has 2 entries but num_actual_tokens=3: one slot per scheduled token is required."
    with pytest.raises(MetadataError, match="block_table_tensor has 1 blocks of 4 tokens"):
        builder.update_block_table(builder.build(0, cm), short, cm.slot_mapping)


def test_update_block_table_reads_the_new_table_and_slots():
    b = make_paged_batch([5, 6], [1, 2], block_size=BLOCK, seed=4)
    builder, impl = setup(b)
    md = builder.build(0, b.cm)
    table, slots = b.cm.block_table_tensor.clone(), b.cm.slot_mapping.clone()
    new = builder.update_block_table(md, table, slots)
    assert new.block_table_tensor is table and new.slot_mapping is slots
    assert new.write_slots.tolist() == slots[:b.cm.num_actual_tokens].tolist()
    torch.testing.assert_close(forward(impl, b, new), torch_native_reference(b), atol=1e-5, rtol=1e-5)


def test_values_are_checked_when_validation_is_on(monkeypatch):
    b = make_paged_batch([5, 6], [1, 2], block_size=BLOCK, seed=2)
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    builder, _ = setup(b)
    assert builder.validate_values is True
    bad = b.cm.seq_lens_cpu.clone()
    bad[0] = 99  # longer than the block table holds, and than max_seq_len
    with pytest.raises(MetadataError):
        builder.build(0, types.SimpleNamespace(**{**vars(b.cm), "seq_lens_cpu": bad}))
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "0")
    assert setup(b)[0].validate_values is False


def test_decode_constants_are_sized_from_the_config():
    b = make_paged_batch([5, 9, 3], [1, 1, 1], block_size=BLOCK, seed=6)
    for cfg in (BuilderConfig(3, 64, 256), BuilderConfig(16, 64, 256), None):
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=b.num_kv_heads, head_size=b.head_size,
                                 dtype=b.key_cache.dtype)
        builder = TorchNativeBackend.get_builder_cls()(spec, ["l0"], cfg, "cpu")
        impl = TorchNativeBackend.get_impl_cls()(b.num_heads, b.head_size, b.head_size ** -0.5, b.num_kv_heads)
        md = builder.build(0, b.cm)
        torch.testing.assert_close(forward(impl, b, md), torch_native_reference(b), atol=1e-5, rtol=1e-5)


def test_slots_past_the_steps_tokens_are_never_written():
    """A persistent slot buffer longer than the step holds stale slots past
    ``num_actual_tokens``: only the step's own tokens are written."""
    b = make_paged_batch([5, 6], [1, 2], block_size=BLOCK, seed=2)
    builder, _ = setup(b)
    stale = torch.cat([b.cm.slot_mapping, torch.tensor([7, 8, 9], dtype=b.cm.slot_mapping.dtype)])
    md = builder.build(0, types.SimpleNamespace(**{**vars(b.cm), "slot_mapping": stale}))
    assert md.write_slots.tolist() == b.cm.slot_mapping.tolist() and md.write_token_indices.tolist() == [0, 1, 2]


def test_an_empty_step_with_an_empty_table_builds():
    b = make_paged_batch([5], [1], block_size=BLOCK, seed=2)
    builder, _ = setup(b)
    cm = b.cm
    empty = types.SimpleNamespace(**{**vars(cm), "num_reqs": 0, "num_actual_tokens": 0, "max_query_len": 0,
                                      "max_seq_len": 0, "query_start_loc_cpu": cm.query_start_loc_cpu[:1],
                                      "seq_lens_cpu": cm.seq_lens_cpu[:0],
                                      "block_table_tensor": cm.block_table_tensor[:0, :0]})
    md = builder.build(0, empty)
    assert md.num_reqs == 0 and md.segments == ()


def test_a_one_token_prefix_cascades_with_one_token_blocks():
    b = make_paged_batch([3, 4], [1, 2], block_size=1, seed=8, shared_prefix_blocks=1)
    spec = FullAttentionSpec(block_size=1, num_kv_heads=b.num_kv_heads, head_size=b.head_size, dtype=b.key_cache.dtype)
    builder = TorchNativeBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(8, 64, 256), "cpu")
    impl = TorchNativeBackend.get_impl_cls()(b.num_heads, b.head_size, b.head_size ** -0.5, b.num_kv_heads)
    md = builder.build(1, b.cm)
    assert md.cascade is not None and md.cascade.common_prefix_len == 1
    torch.testing.assert_close(forward(impl, b, md), torch_native_reference(b), atol=1e-5, rtol=1e-5)
