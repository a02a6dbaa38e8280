"""Sliding-window groups end to end in the scheduler and the step compiler.

The block pool frees blocks no future query can see; the runner derives the same set
from ``num_computed_tokens`` and nulls them in its block table every step, so its block
lists equal the scheduler's (nulls included), no slot or kernel read can reach a freed
block, and ``validate`` (with its sliding-window check) holds every step.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
from attnplug.cache_groups.sliding_window import (
    first_visible_key,
    flash_attn_window_size,
    flashinfer_window_left,
    max_live_blocks,
    num_skipped_blocks,
    num_skipped_tokens,
    triton_sliding_window,
    window_from_flash_attn,
)
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec, cdiv
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import InvalidSchedulerOutput, KVCacheSpecError, MetadataInvariantError
from attnplug.core.validation import validate
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from attnplug.runner.step.apply_windows import null_skipped_blocks
from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.commands.traces import load_trace, make_prompts


# --- the arithmetic and the kernel conventions ---------------------------------------------
def test_skip_arithmetic_scalar_and_vectorized_agree():
    W, B = 6, 4
    n = np.arange(40)
    assert num_skipped_tokens(n, W).tolist() == [max(0, int(x) - W + 1) for x in n]
    assert num_skipped_blocks(n, W, B).tolist() == [max(0, int(x) - W + 1) // B for x in n]
    assert first_visible_key(9, W) == 4  # query 9 sees keys 4..9
    assert max_live_blocks(W, 8, B) == cdiv(W - 1 + 8, B) + 1


def test_window_conventions_per_kernel_family():
    assert flash_attn_window_size(4096) == (4095, 0) and flash_attn_window_size(None) == (-1, -1)
    assert flashinfer_window_left(4096) == 4095 and flashinfer_window_left(None) == -1
    assert triton_sliding_window(4096) == 4096 and triton_sliding_window(None) == 0
    assert window_from_flash_attn((4095, 0)) == 4096 and window_from_flash_attn((-1, -1)) is None
    for bad in (0, -3, True, 2.5):
        with pytest.raises(KVCacheSpecError):
            flash_attn_window_size(bad)
    with pytest.raises(KVCacheSpecError):
        window_from_flash_attn((3, 2))


# --- the runner's block table ---------------------------------------------------------------
def _sc(windows=(None, 6), **kw):
    return StepCompiler([4, 4], max_num_reqs=4, max_model_len=64, max_num_batched_tokens=32,
                        kernel_block_sizes=[4, 2], num_blocks=64, group_kinds=["full_attention", "sliding_window"],
                        sliding_windows=list(windows), validate=True, **kw)


def _new(rid, n_prompt, blocks, n_sched):
    return SchedulerOutput([NewRequestData(rid, list(range(n_prompt)), blocks, 0, SamplingParams())],
                           CachedRequestData(), {rid: n_sched})


def _cached(rid, ncc, n, blocks=None, resumed=False):
    c = CachedRequestData([rid], [resumed], [[]], [blocks], [ncc])
    return SchedulerOutput([], c, {rid: n})


def test_runner_nulls_skipped_blocks_without_shifting_the_table():
    sc = _sc()
    sc.update_states(_new("a", 20, ([1, 2, 3], [5, 6, 7]), 12))
    sc.prepare_inputs()
    assert sc.requests["a"].block_ids == ([1, 2, 3], [5, 6, 7])
    sc.update_states(_cached("a", 12, 6, ([4, 8], [9, 10])))
    # after 12 computed tokens, W=6: tokens 0..6 skippable -> manager block 0 (tokens 0..3) freed
    assert sc.requests["a"].block_ids == ([1, 2, 3, 4, 8], [NULL_BLOCK_ID, 6, 7, 9, 10])
    bt = sc.input_batch.block_table[1]
    # the kernel table (2-token kernel blocks) is nulled too; logical block 1 is still kernel 2, 3
    assert bt.kernel_block_table.np[0, :4].tolist() == [NULL_BLOCK_ID, NULL_BLOCK_ID, 12, 13]
    inputs = sc.prepare_inputs()  # validate=True: the sliding-window check runs
    assert inputs.common_attn_metadata[1].block_table_tensor[0, :2].tolist() == [NULL_BLOCK_ID] * 2
    # full-attention group untouched
    assert sc.input_batch.block_table[0].row_block_ids(0) == [1, 2, 3, 4, 8]
    # idempotent: nothing left to null this step
    assert null_skipped_blocks(sc.input_batch, sc.sliding_windows) == 0


def test_nulling_follows_rows_through_moves_and_unscheduling():
    sc = _sc()
    so = SchedulerOutput([NewRequestData("a", list(range(9)), ([1, 2, 3], [11, 12, 13]), 0, SamplingParams()),
                          NewRequestData("b", list(range(30)), ([4, 5, 6, 7, 8, 9, 10, 15], [21, 22, 23, 24, 25, 26, 27, 28]),
                                         0, SamplingParams())],
                         CachedRequestData(), {"a": 2, "b": 30})
    sc.update_states(so)
    sc.prepare_inputs()
    sc.append_output_tokens(["b"], [5])
    # a finishes; b moves from row 1 to row 0 and has 30 computed -> 25 skippable -> 6 blocks
    so = SchedulerOutput([], CachedRequestData(["b"], [False], [[]], [None], [30]), {"b": 1},
                         finished_req_ids={"a"})
    sc.update_states(so)
    assert sc.input_batch.req_id_to_index == {"b": 0}
    assert sc.requests["b"].block_ids[1] == [NULL_BLOCK_ID] * 6 + [27, 28]
    assert sc.input_batch.num_computed_tokens_nulled[0] == 30
    sc.prepare_inputs()
    sc.append_output_tokens(["b"], [6])
    # unscheduled: the detached state keeps the nulls; scheduled again it is re-added (nulls rewritten)
    sc.update_states(SchedulerOutput([], CachedRequestData(), {}))
    assert sc.requests["b"].row is None and sc.requests["b"].block_ids[1][:6] == [NULL_BLOCK_ID] * 6
    sc.update_states(_cached("b", 31, 1))
    assert sc.requests["b"].block_ids[1] == [NULL_BLOCK_ID] * 6 + [27, 28]
    sc.prepare_inputs()


def test_resumed_request_gets_fresh_blocks_and_nothing_nulled():
    sc = _sc()
    sc.update_states(_new("a", 40, ([1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17]), 20))
    sc.prepare_inputs()
    sc.update_states(_cached("a", 20, 8))
    assert sc.requests["a"].block_ids[1][:3] == [NULL_BLOCK_ID] * 3
    sc.prepare_inputs()
    # preempted and resumed in the next step: replacement ids, recompute from 0
    sc.update_states(_cached("a", 0, 8, ([30, 31], [32, 33]), resumed=True))
    assert sc.requests["a"].block_ids == ([30, 31], [32, 33])
    assert sc.input_batch.num_computed_tokens_nulled[0] == 0
    sc.prepare_inputs()


def test_going_back_behind_the_nulled_window_is_rejected_and_changes_nothing():
    sc = _sc()
    sc.update_states(_new("a", 40, ([1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17]), 20))
    sc.prepare_inputs()
    sc.update_states(_cached("a", 20, 4))
    snap = sc.snapshot()
    with pytest.raises(InvalidSchedulerOutput, match="behind the sliding window"):
        sc.update_states(_cached("a", 2, 4))
    after = sc.snapshot()
    assert all(np.array_equal(x, y) for x, y in zip(snap["columns"], after["columns"]))
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(snap["block_tables"], after["block_tables"]))


def test_validate_catches_a_live_block_before_the_window():
    sc = _sc(windows=(None, None))  # no nulling: the runner keeps the scheduler's ids
    sc.update_states(_new("a", 40, ([1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17]), 20))
    sc.prepare_inputs()
    sc.update_states(_cached("a", 20, 4))
    inputs = sc.prepare_inputs()
    with pytest.raises(MetadataInvariantError, match="7 slots"):
        validate(inputs.common_attn_metadata[1], block_size=2, sliding_window=6, manager_block_size=4)


def test_bad_sliding_windows_argument():
    with pytest.raises(KVCacheSpecError):
        _sc(windows=(6, 6))  # a window on a full-attention group
    with pytest.raises(KVCacheSpecError):
        _sc(windows=(None, 0))


# --- scheduler and runner together ----------------------------------------------------------
@pytest.mark.parametrize("force_preemption_every", [None, 5])
def test_scheduler_and_runner_agree_on_nulled_blocks(force_preemption_every):
    """Hundreds of steps under chunked prefill and preemption: the runner's block lists equal
    the scheduler's (nulls included) and ``validate`` holds every step."""
    W, max_model_len, budget, max_seqs = 13, 160, 24, 6
    kv = KVCacheConfig(48, (
        KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=8)),
        KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=8, sliding_window=W)),
    ))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                      max_model_len=max_model_len, force_preemption_every=force_preemption_every), kv)
    sc = StepCompiler(kv, max_num_reqs=max_seqs, max_model_len=max_model_len, max_num_batched_tokens=budget,
                      kernel_block_sizes=[8, 4], validate=True)
    assert sc.sliding_windows == [None, W]
    trace = load_trace("conv", 16, max_model_len=max_model_len, scale=10.0)
    for i, (r, prompt) in enumerate(zip(trace, make_prompts(trace, vocab_size=500, seed=1))):
        sched.add_request(f"r{i}", prompt, SamplingParams(max_tokens=min(r.output_len, 20)))
    steps = nulls_seen = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sc.update_states(out)
        for rid in out.num_scheduled_tokens:
            runner_ids = sc.requests[rid].block_ids
            assert runner_ids == tuple(list(b) for b in sched.get_request(rid).block_ids), rid
            nulls_seen += runner_ids[1].count(NULL_BLOCK_ID)
        sampled = {}
        if out.total_num_scheduled_tokens:
            inputs = sc.prepare_inputs(out)
            keep = np.flatnonzero(~inputs.discard)
            ids = [inputs.req_ids[i] for i in keep]
            sc.append_output_tokens(ids, [7] * len(ids))
            sampled = {rid: [7] for rid in ids}
        sched.update_from_output(out, sampled)
        steps += 1
        assert steps < 3000
    assert nulls_seen > 0 and steps > 50
    if force_preemption_every:
        assert sched.num_preemptions > 0


def test_peak_blocks_of_a_long_request_within_the_window_bound():
    """One long request alone: the sliding group's pool peak (what it really held) is at most
    ``cdiv(W - 1 + max_num_batched_tokens, B) + 1``, while full attention holds everything."""
    W, B, budget = 21, 8, 16  # W not a multiple of B
    kv = KVCacheConfig(128, (
        KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=B)),
        KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=B, sliding_window=W)),
    ))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=600), kv)
    sc = StepCompiler(kv, max_num_reqs=4, max_model_len=600, max_num_batched_tokens=budget, validate=True)
    sched.add_request("long", list(range(500)), SamplingParams(max_tokens=40))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sc.update_states(out)
        inputs = sc.prepare_inputs(out)
        keep = [inputs.req_ids[i] for i in np.flatnonzero(~inputs.discard)]
        sc.append_output_tokens(keep, [1] * len(keep))
        sched.update_from_output(out, {r: [1] for r in keep})
    bound = cdiv(W - 1 + budget, B) + 1
    full_peak, swa_peak = sched.peak_blocks_per_group
    assert swa_peak <= bound < full_peak
    assert full_peak == cdiv(539, B)
