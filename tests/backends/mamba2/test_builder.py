"""Mamba2 metadata builder: decodes-first split, state slots, chunk layout, reuse across groups."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from attnplug.backends.mamba2 import Mamba2MetadataBuilder, compute_prefill_layout
from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
from attnplug.cache_groups.specs import FullAttentionSpec, MambaSpec
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import BuilderConfig
from attnplug.core.errors import KVCacheSpecError, MetadataError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
from attnplug.runner.step.scheduler_output import SamplingParams
from attnplug.runner.step.compiler import StepCompiler

SPEC = MambaSpec(block_size=4, conv_state_shape=(6, 3), ssm_state_shape=(2, 3, 4), chunk_size=4)
CFG = BuilderConfig(max_num_reqs=8, max_num_batched_tokens=32, max_model_len=64)


def _builder(spec=SPEC):
    return Mamba2MetadataBuilder(spec, ["m0", "m1"], CFG, "cpu")


def _common(computed, sched, slots, extra_rows=0):
    table = [[s, 0] for s in slots] + [[0, 0]] * extra_rows
    cm = CommonAttentionMetadata.from_lengths(computed, sched, [[s, 0] for s in slots], block_size=64)
    return cm.replace(block_table_tensor=torch.tensor(table, dtype=torch.int32))


def test_decodes_first_split_state_slots_and_chunk_layout():
    # rows: decode (c=5), one-token prompt (c=0), continuation (c=6, q=7), fresh prefill (q=3)
    md = _builder().build(0, _common([5, 0, 6, 0], [1, 1, 7, 3], [3, 5, 2, 7]))
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == (2, 2, 2, 10)
    assert md.state_indices.dtype == torch.int32 and md.state_indices.tolist() == [3, 5, 2, 7]
    assert md.has_initial_state.tolist() == [True, False, True, False]
    assert md.query_start_loc_p.dtype == torch.int32 and md.query_start_loc_p.tolist() == [0, 7, 10]
    assert md.seq_idx.tolist() == [0] * 7 + [1] * 3
    # chunk boundaries at absolute multiples of 4: positions 6 7 | 8..11 | 12 ; 0..2
    assert md.cu_chunk_seqlen.tolist() == [0, 2, 6, 7, 10]
    assert md.chunk_seq_idx.tolist() == [0, 0, 0, 1] and md.last_chunk_indices.tolist() == [2, 3]
    assert (md.num_chunks, md.max_chunks_per_seq, md.chunk_size) == (4, 3, 4)
    assert md.chunk_grid_index.tolist() == [0, 1, 2, 3]
    pad = md.num_prefill_tokens
    assert md.chunk_token_index.view(4, 4).tolist() == [[0, 1, pad, pad], [2, 3, 4, 5], [6, pad, pad, pad],
                                                        [7, 8, 9, pad]]
    assert md.token_chunk_index.tolist() == [0, 1, 4, 5, 6, 7, 8, 12, 13, 14]


def test_one_token_row_behind_a_prefill_goes_to_the_prefill_part():
    md = _builder().build(0, _common([3, 0, 9], [1, 5, 1], [1, 2, 3]))
    assert (md.num_decodes, md.num_prefills, md.num_prefill_tokens) == (1, 2, 6)
    assert md.query_start_loc_p.tolist() == [0, 5, 6] and md.has_initial_state.tolist() == [True, False, True]


def test_pure_decode_and_padded_block_table_rows_get_the_pad_slot():
    md = _builder().build(0, _common([4, 9], [1, 1], [6, 2], extra_rows=3))
    assert (md.num_decodes, md.num_prefills, md.num_chunks, md.max_chunks_per_seq) == (2, 0, 0, 0)
    assert md.query_start_loc_p.tolist() == [0] and md.seq_idx.size == 0
    assert md.state_indices.tolist() == [6, 2, PAD_SLOT_ID, PAD_SLOT_ID, PAD_SLOT_ID]


def _fields_equal(a, b, skip=()):
    for f in dataclasses.fields(a):
        if f.name in skip:
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def test_update_block_table_recomputes_state_indices_and_equals_a_fresh_build():
    cm_a = _common([5, 0, 6], [1, 4, 7], [3, 5, 2])
    cm_b = cm_a.replace(block_table_tensor=torch.tensor([[9, 0], [4, 0], [1, 0]], dtype=torch.int32))
    builder_a, builder_b = _builder(), _builder()
    md_a = builder_a.build(0, cm_a)
    reused = builder_b.update_block_table(md_a, cm_b.block_table_tensor, cm_b.slot_mapping)
    assert reused.state_indices.tolist() == [9, 4, 1]
    assert md_a.state_indices.tolist() == [3, 5, 2], "the cached metadata of the other group was mutated"
    _fields_equal(reused, _builder().build(0, cm_b))
    # the same builder reusing its own output must not overwrite the buffer that output reads
    again = builder_a.update_block_table(md_a, cm_b.block_table_tensor, cm_b.slot_mapping)
    assert again.state_indices.tolist() == [9, 4, 1] and md_a.state_indices.tolist() == [3, 5, 2]


def test_group_builder_reuses_one_build_for_equal_mamba_specs():
    from attnplug.runner.execute.group_metadata import GroupMetadataBuilder

    cm = _common([0, 2], [3, 1], [1, 2])
    other = cm.replace(block_table_tensor=torch.tensor([[7, 0], [8, 0]], dtype=torch.int32))
    gmb = GroupMetadataBuilder([_builder(), _builder()], [["a"], ["b"]])
    per_group, per_layer = gmb.build([cm, other])
    assert (gmb.counters.builds, gmb.counters.reuses) == (1, 1)
    assert per_layer["a"].state_indices.tolist() == [1, 2] and per_layer["b"].state_indices.tolist() == [7, 8]


def test_bad_inputs_raise_clear_errors():
    b = _builder()
    cm = _common([0, 0], [2, 3], [1, 2])
    with pytest.raises(MetadataError, match="one row per request"):
        b.build(0, cm.replace(block_table_tensor=torch.ones(1, 2, dtype=torch.int32)))
    with pytest.raises(MetadataError, match="num_actual_tokens"):
        b.build(0, cm.replace(num_actual_tokens=4))
    with pytest.raises(KVCacheSpecError, match="MambaSpec"):
        Mamba2MetadataBuilder(FullAttentionSpec(block_size=4), [], CFG, "cpu")


def test_layout_handles_empty_sequences_and_chunk_size_one():
    lay = compute_prefill_layout(np.array([0, 3]), np.array([0, 2]), 1, 0)
    assert lay.cu_chunk_seqlen.tolist() == [0, 1, 2, 3] and lay.last_chunk_indices.tolist() == [-1, 2]
    assert lay.conv_window_pos.tolist() == [0, 1, 2]


def _hybrid_compiler(threshold):
    groups = (KVCacheGroupSpec(("attn",), FullAttentionSpec(block_size=4)), KVCacheGroupSpec(("m",), SPEC))
    kv = KVCacheConfig(64, groups, num_state_slots=7)   # 6 running requests + the null slot
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=6, max_model_len=64,
                                      force_preemption_every=4), kv)
    sc = StepCompiler(kv, max_num_reqs=6, max_model_len=64, max_num_batched_tokens=12,
                      reorder_batch_threshold=threshold, validate=True)
    return sched, sc


@pytest.mark.parametrize("threshold", [1, None])
def test_step_compiler_puts_decodes_first_and_slots_follow_the_scheduler(threshold):
    sched, sc = _hybrid_compiler(threshold)
    rng = np.random.default_rng(0)
    for i in range(6):
        sched.add_request(f"r{i}", rng.integers(0, 50, size=int(rng.integers(2, 14))).tolist(),
                          SamplingParams(max_tokens=4))
    builder = Mamba2MetadataBuilder(SPEC, ["m"], BuilderConfig(6, 12, 64), "cpu")
    assert [p.num_blocks for p in sched.kv_cache_manager.pools] == [64, 7]
    misordered = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sc.update_states(out)
        if not out.total_num_scheduled_tokens:
            continue
        inputs = sc.prepare_inputs(out)
        md = builder.build(0, inputs.common_attn_metadata[1])
        q = np.asarray(inputs.num_scheduled_tokens)
        misordered += int(((q[1:] == 1) & (q[:-1] > 1)).any())
        assert (q[:md.num_decodes] == 1).all() and (md.num_decodes == len(q) or q[md.num_decodes] != 1)
        slots = [sched.get_request(rid).block_ids[1] for rid in inputs.req_ids]
        assert all(len(s) == 1 for s in slots), "a running request holds exactly one state slot"
        assert md.state_indices.tolist() == [s[0] for s in slots] and max(s[0] for s in slots) < 7
        assert md.has_initial_state.tolist() == (np.asarray(inputs.num_computed_tokens) > 0).tolist()
        keep = np.flatnonzero(~inputs.discard)
        ids = [inputs.req_ids[i] for i in keep]
        sc.append_output_tokens(ids, [7] * len(ids))
        sched.update_from_output(out, {rid: [7] for rid in ids})
    assert sched.num_preemptions > 0
    assert sched.kv_cache_manager.num_used_blocks_per_group == [0, 0], "finish and preemption free the slots"
    if threshold == 1:
        assert misordered == 0
    else:
        assert misordered > 0, "the workload never needed the decodes-first reorder"


@pytest.mark.parametrize("extra_rows", [0, 2])
def test_decode_only_fast_path_equals_the_full_build(extra_rows, monkeypatch):
    """A step of one-token rows takes the constant-cost path (no prefill layout), checked or
    not; every field equals what the general path (the prefill layout of no prefill) builds."""
    cm = _common([5, 0, 9, 3], [1, 1, 1, 1], [3, 5, 2, 7], extra_rows=extra_rows)
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
    fast_builder = _builder()
    fast_builder.build(0, _common([2, 0], [3, 1], [1, 4]))  # a mixed step first: stale buffers
    fast = fast_builder.build(0, cm)
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    checked = _builder().build(0, cm)
    full = _builder()._build_checked(cm, cm.num_reqs, layout_always=True)
    assert checked.fresh_rows.tolist() == [1] and checked.num_chunks == 0
    _fields_equal(fast, full)
    _fields_equal(checked, full)
    assert fast.fresh_rows.tolist() == [1] and fast.state_indices.tolist() == [3, 5, 2, 7] + [PAD_SLOT_ID] * extra_rows
