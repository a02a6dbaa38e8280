"""Specs, kinds and grouping (cache_groups/specs.py, kinds.py, grouping.py): exact values,
boundaries and the refusals' words, each against an expectation written out by hand."""

from __future__ import annotations

import pytest
import torch

from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec, group_layers_by_spec
from attnplug.cache_groups.kinds import GROUP_KIND_NAMES, GroupKind
from attnplug.cache_groups.specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    _dtype_bytes,
    cdiv,
)
from attnplug.core.errors import KVCacheSpecError


# --- kinds --------------------------------------------------------------------------------
def test_group_kind_parses_names_and_members_and_prints_plain_names():
    assert GROUP_KIND_NAMES == ("full_attention", "sliding_window", "mamba", "mla", "indexer")
    for name in GROUP_KIND_NAMES:
        assert GroupKind.parse(name) is GroupKind(name)
        assert GroupKind.parse(GroupKind(name)) is GroupKind(name)
        assert str(GroupKind(name)) == name and f"{GroupKind(name)}" == name


@pytest.mark.parametrize("bad", ["bogus", "MAMBA", 3, None])
def test_group_kind_refuses_other_values_naming_them_and_the_choices(bad):
    with pytest.raises(ValueError) as e:
        GroupKind.parse(bad)
    assert str(e.value) == (f"unknown cache-group kind {bad!r}: expected one of "
                            "full_attention, sliding_window, mamba, mla, indexer")
    assert e.value.__cause__ is None and e.value.__suppress_context__


# --- specs --------------------------------------------------------------------------------
def test_cdiv_and_dtype_bytes():
    assert [cdiv(a, 4) for a in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert cdiv(7, 1) == 7
    assert {d: _dtype_bytes(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                         torch.int8, torch.int64)} == {
        torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8, torch.int8: 1, torch.int64: 8}


@pytest.mark.parametrize("make, msg", [
    (lambda: FullAttentionSpec(block_size=0), "block_size must be a positive int, got 0"),
    (lambda: FullAttentionSpec(block_size=-3), "block_size must be a positive int, got -3"),
    (lambda: FullAttentionSpec(block_size=2.0), "block_size must be a positive int, got 2.0"),
    (lambda: MambaSpec(block_size="4"), "block_size must be a positive int, got '4'"),
    (lambda: FullAttentionSpec(block_size=4, num_kv_heads=0), "num_kv_heads must be a positive int, got 0"),
    (lambda: FullAttentionSpec(block_size=4, head_size=-1), "head_size must be a positive int, got -1"),
    (lambda: FullAttentionSpec(block_size=4, head_size=8.0), "head_size must be a positive int, got 8.0"),
    (lambda: SlidingWindowSpec(block_size=4), "sliding_window must be a positive int, got 0"),
    (lambda: SlidingWindowSpec(block_size=4, sliding_window=-2), "sliding_window must be a positive int, got -2"),
    (lambda: SlidingWindowSpec(block_size=4, sliding_window=3.0), "sliding_window must be a positive int, got 3.0"),
])
def test_specs_refuse_non_positive_or_non_int_sizes_with_the_field_and_value(make, msg):
    with pytest.raises(KVCacheSpecError) as e:
        make()
    assert str(e.value) == msg


def test_the_smallest_valid_sizes_are_accepted():
    s = SlidingWindowSpec(block_size=1, num_kv_heads=1, head_size=1, sliding_window=1)
    assert (s.block_size, s.num_kv_heads, s.head_size, s.sliding_window) == (1, 1, 1, 1)
    assert MambaSpec(block_size=1).block_size == 1


def test_the_base_spec_has_no_kind_size_or_bound():
    base = KVCacheSpec(block_size=4)
    with pytest.raises(NotImplementedError):
        base.kind
    with pytest.raises(NotImplementedError):
        base.page_size_bytes
    with pytest.raises(NotImplementedError):
        base.max_memory_usage_bytes(16, 8)
    with pytest.raises(NotImplementedError):
        AttentionSpec(block_size=4).kind


def test_attention_page_size_and_full_attention_bound():
    s = FullAttentionSpec(block_size=4, num_kv_heads=3, head_size=5, dtype=torch.float16)
    page = 2 * 4 * 3 * 5 * 2
    assert s.kind is GroupKind.FULL_ATTENTION and s.page_size_bytes == page
    assert AttentionSpec(block_size=2).page_size_bytes == 2 * 2 * 1 * 64 * 4  # the defaults: float32
    # cdiv(max_model_len, block_size) blocks; max_num_batched_tokens does not matter
    assert [s.max_memory_usage_bytes(n, 1000) for n in (1, 4, 5, 9)] == [page, page, 2 * page, 3 * page]


@pytest.mark.parametrize("W, B, T, L", [
    (8, 4, 5, 100),   # window plus step: cdiv(12, 4) + 1 = 4 blocks
    (5, 4, 4, 100),   # cdiv(8, 4) + 1 = 3 (W + 1 would give 4)
    (1, 1, 1, 100),   # cdiv(1, 1) + 1 = 2
    (8, 4, 5, 8),     # capped by full attention: cdiv(8, 4) = 2
    (8, 4, 5, 15),    # cdiv(15, 4) = 4 = the window's 4
    (8, 4, 5, 13),    # cdiv(13, 4) = 4
    (8, 4, 5, 12),    # cdiv(12, 4) = 3 < 4
    (3, 2, 1, 7),     # cdiv(3, 2) + 1 = 3 < cdiv(7, 2) = 4
])
def test_sliding_window_bound_is_window_plus_a_step_plus_one_capped_by_full(W, B, T, L):
    s = SlidingWindowSpec(block_size=B, num_kv_heads=2, head_size=3, dtype=torch.bfloat16, sliding_window=W)
    page = 2 * B * 2 * 3 * 2
    window_blocks = -(-(W - 1 + T) // B) + 1
    full_blocks = -(-L // B)
    assert s.kind is GroupKind.SLIDING_WINDOW and s.page_size_bytes == page
    assert s.max_memory_usage_bytes(L, T) == min(window_blocks, full_blocks) * page


def test_mamba_state_bytes_are_conv_plus_ssm_each_in_its_dtype():
    s = MambaSpec(block_size=64, conv_state_shape=(3, 4), ssm_state_shape=(2, 3, 5),
                  dtype=torch.float16, ssm_dtype=torch.float64)
    assert s.kind is GroupKind.MAMBA
    assert s.page_size_bytes == 3 * 4 * 2 + 2 * 3 * 5 * 8
    assert s.max_memory_usage_bytes(10_000, 512) == s.page_size_bytes == s.max_memory_usage_bytes(1, 1)
    assert MambaSpec(block_size=8).page_size_bytes == 1 * 4 + 1 * 4


# --- grouping -----------------------------------------------------------------------------
A = FullAttentionSpec(block_size=4)
W = SlidingWindowSpec(block_size=4, sliding_window=8)
M = MambaSpec(block_size=16)


def test_layers_group_by_equal_spec_in_order_of_first_appearance():
    specs = {"l0": W, "l1": A, "l2": W, "l3": FullAttentionSpec(block_size=4), "l4": M}
    assert group_layers_by_spec(specs) == (
        KVCacheGroupSpec(("l0", "l2"), W), KVCacheGroupSpec(("l1", "l3"), A), KVCacheGroupSpec(("l4",), M))
    assert group_layers_by_spec({"only": A}) == (KVCacheGroupSpec(("only",), A),)


@pytest.mark.parametrize("cap, expected", [
    (None, [("a0", "a1", "a2", "a3", "a4"), ("w0", "w1")]),
    (5, [("a0", "a1", "a2", "a3", "a4"), ("w0", "w1")]),
    (2, [("a0", "a1"), ("a2", "a3"), ("a4",), ("w0", "w1")]),
    (1, [("a0",), ("a1",), ("a2",), ("a3",), ("a4",), ("w0",), ("w1",)]),
    (3, [("a0", "a1", "a2"), ("a3", "a4"), ("w0", "w1")]),
])
def test_max_layers_per_group_splits_each_spec_into_runs(cap, expected):
    specs = {"a0": A, "w0": W, "a1": A, "a2": A, "w1": W, "a3": A, "a4": A}
    groups = group_layers_by_spec(specs, max_layers_per_group=cap)
    assert [g.layer_names for g in groups] == expected
    assert [g.kv_cache_spec for g in groups] == [A if n[0].startswith("a") else W for n in expected]


def test_grouping_refuses_no_layers_and_non_specs():
    with pytest.raises(KVCacheSpecError) as e:
        group_layers_by_spec({})
    assert str(e.value) == "no layers to group: the model declared no KV-cache specs"
    with pytest.raises(KVCacheSpecError) as e:
        group_layers_by_spec({"l0": A, "l1": "full"})
    assert str(e.value) == "layer 'l1': 'full' is not a KVCacheSpec"


def test_cache_config_bounds_and_duplicate_layers():
    g = (KVCacheGroupSpec(("a", "b"), A), KVCacheGroupSpec(("c",), M))
    assert KVCacheConfig(2, g, num_state_slots=2).num_blocks == 2  # both exactly at the bound
    for bad in (1, 0):
        with pytest.raises(KVCacheSpecError) as e:
            KVCacheConfig(bad, g)
        assert str(e.value) == f"num_blocks must be >= 2 (block 0 is the reserved null block), got {bad}"
        with pytest.raises(KVCacheSpecError) as e:
            KVCacheConfig(8, g, num_state_slots=bad)
        assert str(e.value) == f"num_state_slots must be >= 2 (slot 0 is the reserved null block), got {bad}"
    dup = (KVCacheGroupSpec(("x", "b", "a"), A), KVCacheGroupSpec(("c", "b", "a"), W), KVCacheGroupSpec(("d",), M))
    with pytest.raises(KVCacheSpecError) as e:
        KVCacheConfig(8, dup)
    assert str(e.value) == "layers ['a', 'b'] appear in more than one cache group"


def test_cache_config_sizes_mamba_pools_by_state_slots_when_given():
    g = (KVCacheGroupSpec(("a",), A), KVCacheGroupSpec(("m",), M), KVCacheGroupSpec(("w",), W))
    cfg = KVCacheConfig(100, g, num_state_slots=5)
    assert cfg.block_sizes == [4, 16, 4]
    assert [cfg.num_blocks_of(i) for i in range(3)] == [100, 5, 100]
    assert [KVCacheConfig(100, g).num_blocks_of(i) for i in range(3)] == [100, 100, 100]
