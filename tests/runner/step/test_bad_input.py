"""Bad scheduler outputs raise ``InvalidSchedulerOutput`` naming the request and field, and
leave the runner state byte-identical (every column, both views, the request map)."""

from __future__ import annotations

import copy

import pytest

from attnplug.core.errors import InvalidSchedulerOutput, MetadataError
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff

# two groups: full attention (block 4) and sliding window (block 8, 4-token kernel blocks)
KW = dict(kernel_block_sizes=[4, 4], num_blocks=32, group_kinds=["full_attention", "sliding_window"],
          validate=True)


def make_compiler(native: bool | None = None) -> StepCompiler:
    """A and B in the batch; C resident but unscheduled (state kept, no row)."""
    sc = StepCompiler([4, 8], max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, native=native, **KW)
    sc.update_states(SchedulerOutput([
        NewRequestData("A", [1, 2, 3, 4, 5, 6], ([1, 2], [1])),
        NewRequestData("B", [7, 8, 9], ([3], [2]), sampling_params=SamplingParams(seed=3)),
        NewRequestData("C", [10, 11], ([4], [3]))], CachedRequestData(), {"A": 6, "B": 3, "C": 2}))
    sc.prepare_inputs()
    sc.update_states(SchedulerOutput([], CachedRequestData(
        ["A", "B"], [False, False], [[60], [70]], [None, None], [6, 3]), {"A": 1, "B": 1}))
    sc.prepare_inputs()
    assert sc.input_batch.req_ids == ["A", "B"] and set(sc.requests) == {"A", "B", "C"}
    return sc


def valid_parts():
    """A valid next step, as mutable parts: cached entries and extra fields."""
    cached = {
        "A": dict(resumed=False, tokens=[61], blocks=None, ncc=7),
        "B": dict(resumed=False, tokens=[71], blocks=([5], []), ncc=4),
    }
    return cached, {"A": 1, "B": 1}, [], set()


def build(cached, nst, new, finished, total=None) -> SchedulerOutput:
    cd = CachedRequestData()
    for rid, e in cached.items():
        cd.req_ids.append(rid)
        cd.resumed_from_preemption.append(e["resumed"])
        cd.new_token_ids.append(e["tokens"])
        cd.new_block_ids.append(e["blocks"])
        cd.num_computed_tokens.append(e["ncc"])
    so = SchedulerOutput(new, cd, nst, finished_req_ids=finished)
    if total is not None:
        so.total_num_scheduled_tokens = total
    return so


def assert_same(a, b):
    assert not snapshot_diff(a, b), snapshot_diff(a, b)


def case(fn, req_id, field):
    return pytest.param(fn, req_id, field, id=f"{field}-{req_id}-{fn.__name__}")


def unknown_cached(c, n, new, f): c["Z"] = dict(resumed=False, tokens=[], blocks=None, ncc=0); n["Z"] = 1
def duplicate_new(c, n, new, f): new += [NewRequestData("N", [1], ([6], [6])), NewRequestData("N", [1], ([7], [7]))]; n["N"] = 1
def new_already_resident(c, n, new, f): new.append(NewRequestData("A", [1], ([6], [6]))); n.pop("A"); c.pop("A"); n["A"] = 1
def negative_count(c, n, new, f): n["A"] = -1
def zero_count(c, n, new, f): n["B"] = 0
def float_count(c, n, new, f): n["A"] = 1.5
def missing_count(c, n, new, f): n.pop("A")
def extra_count(c, n, new, f): n["Q"] = 1
def more_tokens_than_held(c, n, new, f): n["A"] = 3
def negative_computed(c, n, new, f): c["A"]["ncc"] = -1
def computed_beyond_held(c, n, new, f): c["A"]["ncc"] = 9
def block_outside_pool(c, n, new, f): c["A"]["blocks"] = ([32], [])
def null_block_appended(c, n, new, f): c["A"]["blocks"] = ([], [0])
def null_block_in_new_full_group(c, n, new, f): new.append(NewRequestData("N", [1, 2], ([0], [6]))); n["N"] = 2
def null_block_where_a_query_reads(c, n, new, f): new.append(NewRequestData("N", list(range(12)), ([6, 7, 8], [9, 0]), 8)); n["N"] = 4
def too_many_tokens(c, n, new, f): new.append(NewRequestData("N", list(range(20)), ([6, 7, 8, 9, 10], [6, 7, 8]))); n["N"] = 15
def beyond_max_model_len(c, n, new, f): c["A"]["tokens"] = list(range(30))
def prompt_too_long(c, n, new, f): new.append(NewRequestData("N", list(range(33)), ([6], [6]))); n["N"] = 1
def block_table_too_short(c, n, new, f): c["B"]["blocks"] = None
def new_block_table_too_short(c, n, new, f): new.append(NewRequestData("N", list(range(9)), ([6, 7], [6]))); n["N"] = 9
def too_many_blocks(c, n, new, f): c["A"]["blocks"] = (list(range(6, 13)), [])
def unknown_finished(c, n, new, f): f.add("Z")
def finished_and_scheduled(c, n, new, f): f.add("A")
def negative_token(c, n, new, f): new.append(NewRequestData("N", [1, -2], ([6], [6]))); n["N"] = 2
def string_token(c, n, new, f): c["A"]["tokens"] = ["x"]
def empty_prompt(c, n, new, f): new.append(NewRequestData("N", [], ([6], [6]))); n["N"] = 1
def bad_sampling(c, n, new, f): new.append(NewRequestData("N", [1], ([6], [6]), sampling_params=SamplingParams(top_p=0.0))); n["N"] = 1
def wrong_group_count(c, n, new, f): new.append(NewRequestData("N", [1], ([6],))); n["N"] = 1
def resumed_without_blocks(c, n, new, f): c["C"] = dict(resumed=True, tokens=[], blocks=([], []), ncc=0); n["C"] = 2
def returning_beyond_blocks(c, n, new, f): c["C"] = dict(resumed=False, tokens=[12, 13, 14], blocks=None, ncc=2); n["C"] = 3
def extra_zero_count(c, n, new, f): n["Q"] = 0
def block_delta_not_a_list(c, n, new, f): c["B"]["blocks"] = ([5], "x")
def resumed_wrong_group_count(c, n, new, f): c["C"] = dict(resumed=True, tokens=[], blocks=([6],), ncc=0); n["C"] = 2
def new_block_outside_pool(c, n, new, f): new.append(NewRequestData("N", [1], ([40], [6]))); n["N"] = 1
def prompt_a_range(c, n, new, f): new.append(NewRequestData("N", range(3), ([6], [6]))); n["N"] = 3
def appended_ids_not_ints(c, n, new, f): c["A"]["blocks"] = ([1.5], [])
def new_without_count(c, n, new, f): new.append(NewRequestData("N", [1], ([6], [6])))
def finished_and_readded(c, n, new, f): c["C"] = dict(resumed=False, tokens=[], blocks=None, ncc=1); n["C"] = 1; f.add("C")
def negative_temperature(c, n, new, f): new.append(NewRequestData("N", [1], ([6], [6]), sampling_params=SamplingParams(temperature=-1.0))); n["N"] = 1
def seed_too_large(c, n, new, f): new.append(NewRequestData("N", [1], ([6], [6]), sampling_params=SamplingParams(seed=2**64))); n["N"] = 1
def new_beyond_its_prompt(c, n, new, f): new.append(NewRequestData("N", [1, 2], ([6], [6]), 1)); n["N"] = 2
def resumed_id_at_int32_max(c, n, new, f): c["C"] = dict(resumed=True, tokens=[], blocks=([2**31 - 1], [6]), ncc=0); n["C"] = 2
def output_ids_not_a_list(c, n, new, f):
    nr = NewRequestData("N", [1], ([6], [6])); nr.output_token_ids = "abc"; new.append(nr); n["N"] = 1
def block_twice_in_new_list(c, n, new, f): new.append(NewRequestData("N", list(range(8)), ([6, 6], [6]))); n["N"] = 8
def block_twice_appended(c, n, new, f): c["A"]["blocks"] = ([6, 6], [])
def appended_block_already_held(c, n, new, f): c["A"]["blocks"] = ([2], [])
def block_twice_resumed(c, n, new, f): c["C"] = dict(resumed=True, tokens=[], blocks=([6, 6], [7]), ncc=0); n["C"] = 2
def cached_id_not_a_str(c, n, new, f): c[5] = dict(resumed=False, tokens=[], blocks=None, ncc=0); n[5] = 1
def finished_id_not_a_str(c, n, new, f): f.add(5)
def computed_beyond_int64(c, n, new, f): c["A"]["ncc"] = 2**63
def too_many_requests(c, n, new, f):
    for i in range(3):
        new.append(NewRequestData(f"N{i}", [1], ([6 + i], [6 + i]))); n[f"N{i}"] = 1


CASES = [
    case(unknown_cached, "Z", "scheduled_cached_reqs"),
    case(duplicate_new, "N", "scheduled_new_reqs"),
    case(new_already_resident, "A", "scheduled_new_reqs"),
    case(negative_count, "A", "num_scheduled_tokens"),
    case(zero_count, "B", "num_scheduled_tokens"),
    case(float_count, "A", "num_scheduled_tokens"),
    case(missing_count, "A", "num_scheduled_tokens"),
    case(extra_count, "Q", "num_scheduled_tokens"),
    case(more_tokens_than_held, "A", "num_scheduled_tokens"),
    case(negative_computed, "A", "num_computed_tokens"),
    case(computed_beyond_held, "A", "num_computed_tokens"),
    case(block_outside_pool, "A", "new_block_ids"),
    case(null_block_appended, "A", "new_block_ids"),
    case(null_block_in_new_full_group, "N", "block_ids"),
    case(null_block_where_a_query_reads, "N", "block_ids"),
    case(too_many_tokens, None, "num_scheduled_tokens"),
    case(beyond_max_model_len, "A", "new_token_ids"),
    case(prompt_too_long, "N", "prompt_token_ids"),
    case(block_table_too_short, "B", "new_block_ids"),
    case(new_block_table_too_short, "N", "block_ids"),
    case(too_many_blocks, "A", "new_block_ids"),
    case(unknown_finished, "Z", "finished_req_ids"),
    case(finished_and_scheduled, "A", "finished_req_ids"),
    case(negative_token, "N", "prompt_token_ids"),
    case(string_token, "A", "new_token_ids"),
    case(empty_prompt, "N", "prompt_token_ids"),
    case(bad_sampling, "N", "sampling_params"),
    case(wrong_group_count, "N", "block_ids"),
    case(resumed_without_blocks, "C", "new_block_ids"),
    case(returning_beyond_blocks, "C", "new_block_ids"),
    case(too_many_requests, None, "num_scheduled_tokens"),
    case(extra_zero_count, "Q", "num_scheduled_tokens"),
    case(block_delta_not_a_list, "B", "new_block_ids"),
    case(resumed_wrong_group_count, "C", "new_block_ids"),
    case(new_block_outside_pool, "N", "block_ids"),
    case(prompt_a_range, "N", "prompt_token_ids"),
    case(appended_ids_not_ints, "A", "new_block_ids"),
    case(new_without_count, "N", "num_scheduled_tokens"),
    case(finished_and_readded, "C", "finished_req_ids"),
    case(negative_temperature, "N", "sampling_params"),
    case(seed_too_large, "N", "sampling_params"),
    case(new_beyond_its_prompt, "N", "num_scheduled_tokens"),
    case(resumed_id_at_int32_max, "C", "new_block_ids"),
    case(output_ids_not_a_list, "N", "output_token_ids"),
    case(block_twice_in_new_list, "N", "block_ids"),
    case(block_twice_appended, "A", "new_block_ids"),
    case(appended_block_already_held, "A", "new_block_ids"),
    case(block_twice_resumed, "C", "new_block_ids"),
    case(cached_id_not_a_str, None, "scheduled_cached_reqs.req_ids"),
    case(finished_id_not_a_str, None, "finished_req_ids"),
    case(computed_beyond_int64, "A", "num_computed_tokens"),
]


@pytest.mark.parametrize("mutate,req_id,field", CASES)
def test_bad_output_is_rejected_and_changes_nothing(mutate, req_id, field):
    sc = make_compiler()
    before = sc.snapshot()
    cached, nst, new, finished = valid_parts()
    mutate(cached, nst, new, finished)
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.update_states(build(cached, nst, new, finished))
    assert isinstance(info.value, ValueError)
    assert (info.value.req_id, info.value.field) == (req_id, field), str(info.value)
    assert_same(sc.snapshot(), before)
    # the compiler still works: the valid step applies cleanly afterwards
    sc.update_states(build(*valid_parts()))
    inp = sc.prepare_inputs()
    assert inp.req_ids == ["A", "B"] and inp.positions.tolist() == [7, 4]


def test_inconsistent_total_and_ragged_cached_lists():
    sc = make_compiler()
    before = sc.snapshot()
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.update_states(build(*valid_parts(), total=5))
    assert (info.value.req_id, info.value.field) == (None, "total_num_scheduled_tokens")
    so = build(*valid_parts())
    so.scheduled_cached_reqs.num_computed_tokens.pop()
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.update_states(so)
    assert info.value.field == "scheduled_cached_reqs.num_computed_tokens"
    assert_same(sc.snapshot(), before)


def test_prepare_inputs_rejects_an_output_it_did_not_apply():
    sc = make_compiler()
    with pytest.raises(InvalidSchedulerOutput, match="update_states"):
        sc.prepare_inputs(SchedulerOutput(num_scheduled_tokens={"A": 3}))
    with pytest.raises(MetadataError, match="num_tokens_padded"):
        sc.prepare_inputs(num_tokens_padded=1)


@pytest.mark.parametrize("ids,tokens,match", [
    (["C"], [[5]], "not in this step's batch"),
    (["A", "A"], [[5], [6]], "appears twice"),
    (["A"], [[-5]], r"\[0, 2\*\*31\)"),
    (["A"], [[5], [6]], "token entries"),
])
def test_append_output_tokens_rejects_bad_calls_and_changes_nothing(ids, tokens, match):
    sc = make_compiler()
    before = sc.snapshot()
    with pytest.raises(MetadataError, match=match):
        sc.append_output_tokens(ids, tokens)
    assert_same(sc.snapshot(), before)


def test_append_to_a_discarded_row_is_refused():
    sc = StepCompiler([4], 2, 32, 16, validate=True)
    so = SchedulerOutput([NewRequestData("P", list(range(10)), ([1, 2, 3],))], CachedRequestData(), {"P": 4})
    sc.update_states(so)
    inp = sc.prepare_inputs(so)
    assert inp.discard.tolist() == [True]  # a partial prefill
    before = sc.snapshot()
    with pytest.raises(MetadataError, match="discarded"):
        sc.append_output_tokens(["P"], [7])
    assert_same(sc.snapshot(), before)


def test_finished_state_is_dropped_and_reading_it_raises():
    sc = make_compiler()
    st = sc.requests["A"]
    cached, nst, new, finished = valid_parts()
    cached.pop("A"), nst.pop("A"), finished.add("A")
    sc.update_states(build(cached, nst, new, finished))
    assert "A" not in sc.requests and st.row is None
    with pytest.raises(MetadataError) as info:
        st.all_token_ids
    assert str(info.value) == "request 'A' finished and its state was dropped; keep what you need before it finishes"
    assert copy.copy(sc.input_batch.req_ids) == ["B"]


def test_state_slot_beyond_a_mamba_pool_is_rejected_with_its_group():
    """Mamba groups have their own (smaller) pool of state slots: an id valid for the
    attention pool but not for the state pool is a clear error naming the group."""
    from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
    from attnplug.cache_groups.specs import FullAttentionSpec, MambaSpec

    cfg = KVCacheConfig(64, (KVCacheGroupSpec(("attn",), FullAttentionSpec(block_size=4)),
                             KVCacheGroupSpec(("mamba",), MambaSpec(block_size=64))), num_state_slots=4)
    sc = StepCompiler(cfg, max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64)
    assert sc.num_blocks_per_group == [64, 4]
    before = sc.snapshot()
    bad = NewRequestData("b", [1, 2, 3], ([6], [9]), 0)
    with pytest.raises(InvalidSchedulerOutput) as e:
        sc.update_states(SchedulerOutput([bad], num_scheduled_tokens={"b": 3}))
    assert e.value.req_id == "b" and "group 1" in str(e.value) and "[1, 4)" in str(e.value)
    assert_same(before, sc.snapshot())
    sc.update_states(SchedulerOutput([NewRequestData("b", [1, 2, 3], ([9], [3]), 0)], num_scheduled_tokens={"b": 3}))
    assert sc.input_batch.num_reqs == 1
