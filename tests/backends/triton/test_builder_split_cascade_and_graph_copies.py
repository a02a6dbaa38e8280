"""TritonMetadataBuilder at its edges (mutation-testing survivors, issue 23): the spec it
reads (heads for the split-KV decision, window, the spec itself), the cascade fields an
eager build adds and ``update_block_table`` recomputes, a graph build's split decision at
``max_model_len``, ``update_block_table`` copying into its own buffers, and each
refusal's exact wording. Metadata only: no kernel runs here."""

from __future__ import annotations

import re
import types

import pytest
import torch

from attnplug.backends.triton import TritonMetadataBuilder
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import BuilderConfig
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32)
CFG = BuilderConfig(max_num_reqs=4, max_num_batched_tokens=64, max_model_len=128)


def _cm(computed, scheduled, table, block_size=16):
    return CommonAttentionMetadata.from_lengths(computed, scheduled, table, block_size=block_size)


def _table(seq_lens, start=1, block_size=16):
    rows, at = [], start
    for n in seq_lens:
        k = -(-n // block_size)
        rows.append(list(range(at, at + k)))
        at += k
    width = max(len(r) for r in rows)
    return [r + [0] * (width - len(r)) for r in rows]


def test_the_builder_keeps_its_spec_and_reads_heads_and_window_from_it():
    b = TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu")
    assert b.kv_cache_spec is SPEC and (b.num_kv_heads, b.sliding_window, b.block_size) == (2, None, 16)
    w = TritonMetadataBuilder(SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, sliding_window=5),
                              ["l0"], CFG, "cpu")
    assert w.sliding_window == 5
    headless = types.SimpleNamespace(block_size=32)  # a spec without a KV-head count: one head
    assert TritonMetadataBuilder(headless, ["l0"], CFG, "cpu").num_kv_heads == 1


def test_split_kv_decision_counts_the_specs_kv_heads():
    """``num_sms * 4 / (num_reqs * num_kv_heads)`` programs' worth of splits: 64 KV heads
    over 2 requests leave room for 4 splits (5 rounded down); 2 heads for 8 (4001 keys:
    15 segments of 256 at most, rounded down)."""
    cfg = BuilderConfig(max_num_reqs=2, max_num_batched_tokens=8, max_model_len=4096)
    table = _table([4001, 4001])
    cm = _cm([4000, 4000], [1, 1], table)
    many = FullAttentionSpec(block_size=16, num_kv_heads=64, head_size=32)
    assert TritonMetadataBuilder(many, ["l0"], cfg, "cpu").build(0, cm).num_kv_splits == 4
    assert TritonMetadataBuilder(SPEC, ["l0"], cfg, "cpu").build(0, cm).num_kv_splits == 8


def test_graph_builds_plan_splits_for_max_model_len():
    """A graph replays with longer contexts than its capture: a decode graph build plans
    the splits for ``max_model_len`` keys, not the capture's."""
    cfg = BuilderConfig(max_num_reqs=2, max_num_batched_tokens=8, max_model_len=4096)
    b = TritonMetadataBuilder(SPEC, ["l0"], cfg, "cpu")
    cm = _cm([5, 7], [1, 1], _table([6, 8]))
    assert b.build(0, cm).num_kv_splits == 1  # short contexts: unified
    g = b.build_for_cudagraph_capture(cm)
    assert g.num_kv_splits == 16 and g.max_seq_len == 8 and g.graph is True
    assert b.build(0, cm).graph is False


@pytest.mark.parametrize("limits", [(0, 64, 128), (4, 0, 128), (4, 64, 0), (-2, 64, 128)])
def test_non_positive_limits_are_refused(limits):
    with pytest.raises(MetadataError, match="TritonMetadataBuilder: BuilderConfig limits must be positive"):
        TritonMetadataBuilder(SPEC, ["l0"], BuilderConfig(*limits), "cpu")
    assert TritonMetadataBuilder(SPEC, ["l0"], BuilderConfig(1, 1, 1), "cpu").max_num_blocks_per_req == 1


def test_refusals_say_what_to_do(monkeypatch):
    with pytest.raises(MetadataError, match=re.escape(
            "give it the kernel spec (the runner maps manager blocks to kernel blocks with "
            "TritonBackend.get_supported_kernel_block_size)") + "$"):
        TritonMetadataBuilder(FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=32), ["l"], CFG, "cpu")
    cm = _cm([1] * 5, [1] * 5, _table([2] * 5))
    with pytest.raises(MetadataError, match=re.escape(
            "5 request rows exceed BuilderConfig.max_num_reqs=4: the persistent buffers hold that many requests; "
            "raise max_num_reqs (max_num_seqs) when creating the runner.") + "$"):
        TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu").build(0, cm)
    wide = _cm([5, 0], [1, 7], [[1, 0], [2, 3]])
    wide = wide.replace(query_start_loc=wide.query_start_loc.long())
    for validate in (None, "1"):
        if validate:
            monkeypatch.setenv("ATTNPLUG_VALIDATE", validate)
        else:
            monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
        with pytest.raises(MetadataError, match="the triton builder needs torch.int32"):
            TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu").build(0, wide)


def test_eager_build_cuts_longer_seq_lens_to_the_requests():
    b = TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu")
    cm = _cm([5, 0], [1, 7], [[1, 0], [2, 3]])
    longer = cm.replace(seq_lens=torch.tensor([6, 7, 9, 9], dtype=torch.int32))
    assert b.build(0, longer).seq_lens.tolist() == [6, 7]


def _shared_step(seed_block):
    """Three requests sharing their first two 16-token blocks; the smallest context is 40."""
    computed, scheduled = [40, 50, 45], [1, 2, 3]
    own = _table([n - 32 for n in (41, 52, 48)], start=seed_block)
    table = [[7, 8] + row for row in own]
    return _cm(computed, scheduled, table), table


def test_an_eager_build_adds_the_cascade_fields_and_a_window_turns_them_off():
    cm, table = _shared_step(20)
    b = TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu")
    c = b.build(45, cm).cascade  # clamped to 40, rounded down to 32
    assert c is not None and c.common_prefix_len == 32
    assert c.prefix_query_start_loc.tolist() == [0, 6] and c.prefix_seq_lens.tolist() == [32]
    assert c.prefix_block_table.tolist() == [[7, 8]] and c.suffix_seq_lens.tolist() == [9, 20, 16]
    assert c.suffix_block_table.tolist() == [row[2:] for row in table]
    assert b.build(0, cm).cascade is None and b.build(15, cm).cascade is None  # nothing, or under a block
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, sliding_window=64)
    assert TritonMetadataBuilder(window, ["l0"], CFG, "cpu").build(45, cm).cascade is None


def test_update_block_table_recomputes_the_cascade_for_the_other_groups_blocks():
    cm, _ = _shared_step(20)
    other, other_table = _shared_step(40)
    other_table = [[9, 10] + row[2:] for row in other_table]
    other = other.replace(block_table_tensor=torch.tensor(other_table, dtype=torch.int32))
    b0, b1 = (TritonMetadataBuilder(SPEC, [f"l{g}"], CFG, "cpu") for g in range(2))
    md = b0.build(45, cm)
    up = b1.update_block_table(md, other.block_table_tensor, other.slot_mapping)
    c = up.cascade
    assert c is not None and c.common_prefix_len == 32 and c.prefix_block_table.tolist() == [[9, 10]]
    assert c.suffix_block_table.tolist() == [row[2:] for row in other_table]
    assert c.suffix_seq_lens.tolist() == [9, 20, 16] and c.prefix_query_start_loc.tolist() == [0, 6]
    assert md.cascade.prefix_block_table.tolist() == [[7, 8]], "the source is not mutated"


def test_graph_update_block_table_copies_into_its_own_buffers_and_refuses_another_block_size():
    cm0 = _cm([5, 20], [1, 7], [[1, 0], [2, 3]])
    cm1 = cm0.replace(block_table_tensor=torch.tensor([[6, 0], [7, 8]], dtype=torch.int32),
                      slot_mapping=torch.tensor([101, 120, 121, 122, 123, 124, 125, 126]))
    b0, b1, b2 = (TritonMetadataBuilder(SPEC, [f"l{g}"], CFG, "cpu") for g in range(3))
    g0 = b0.build_for_cudagraph_capture(cm0)
    g1 = b1.update_block_table(g0, cm1.block_table_tensor, cm1.slot_mapping)
    for f, buf in (("query_start_loc", b1._query_start_loc), ("seq_lens", b1._seq_lens),
                   ("block_table_tensor", b1._block_table), ("slot_mapping", b1._slot_mapping)):
        assert getattr(g1, f).data_ptr() == buf.data_ptr(), f"{f}: in b1's own buffers"
    fresh = b2.build_for_cudagraph_capture(cm1)  # its own buffers: b1's are what is compared
    for f in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
        assert torch.equal(getattr(g1, f), getattr(fresh, f)), f
    assert g1.seq_lens.tolist() == [6, 27] and g1.block_table_tensor[:, :2].tolist() == [[6, 0], [7, 8]]
    b32 = TritonMetadataBuilder(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32), ["l"], CFG, "cpu")
    with pytest.raises(MetadataError, match="metadata has block_size 16, this builder 32: only groups with the same"):
        b32.update_block_table(g0, torch.tensor([[1], [2]], dtype=torch.int32), cm1.slot_mapping)
    assert PAD_SLOT_ID not in g1.slot_mapping.tolist()
