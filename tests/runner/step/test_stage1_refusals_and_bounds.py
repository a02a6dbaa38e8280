"""Stage 1 at its edges, found by mutation testing (docs/mutation-testing.md): the exact request,
field and words of each refusal, the bounds themselves (a seed of exactly -2**63, a ``top_k``
at the ``int32`` bounds, an empty ``uint64`` block list), drafts for a row whose new tokens
arrive in the same output, and the views a user prints (``CachedRequestState.__repr__``).
Each refusal leaves the state unchanged; no ``ATTNPLUG_VALIDATE`` needed."""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput


def two_groups(native: bool = False) -> StepCompiler:
    """Full attention (block 4) and a sliding window of 4 tokens (block 4); A holds 6 tokens."""
    sc = StepCompiler([4, 4], max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, num_blocks=16,
                      group_kinds=["full_attention", "sliding_window"], sliding_windows=[None, 4], native=native)
    so = SchedulerOutput([NewRequestData("A", [1, 2, 3, 4, 5, 6], ([1, 2], [1, 2]))], CachedRequestData(), {"A": 6})
    sc.update_states(so)
    sc.prepare_inputs(so)
    sc.append_output_tokens(["A"], [7])
    return sc


def refused(sc: StepCompiler, so: SchedulerOutput) -> InvalidSchedulerOutput:
    before = sc.snapshot()
    with pytest.raises(InvalidSchedulerOutput) as e:
        sc.update_states(so)
    assert not snapshot_diff(before, sc.snapshot())
    return e.value


def new(rid: str, blocks, n: int = 3, **kw) -> SchedulerOutput:
    return SchedulerOutput([NewRequestData(rid, list(range(10, 10 + n)), blocks, **kw)], CachedRequestData(), {rid: n})


@pytest.mark.parametrize("native", [False, True])
def test_block_id_refusals_name_request_field_and_words(native):
    sc = two_groups(native)
    so = SchedulerOutput([], CachedRequestData(["A"], [True], [[]], [([1, 2], [1, 2**31])], [6]), {"A": 1})
    e = refused(sc, so)  # a resumed request's replacement lists
    assert (e.req_id, e.field) == ("A", "new_block_ids"), str(e)
    assert "group 1: block ids must be in [0, 2**31), got [1, 2147483648]" in str(e), str(e)
    e = refused(sc, new("N", ([3] * 9, [4])))
    assert (e.req_id, e.field) == ("N", "block_ids")
    assert "group 0: 9 blocks but a request holds at most 8 (cdiv(max_model_len=32, block_size=4))" in str(e)


def test_a_null_block_a_window_query_sees_names_the_window():
    sc = two_groups()
    # A computes position 6 next; window 4 sees positions [3, 7): block 0 of group 1 (positions 0-3) is seen
    so = SchedulerOutput([], CachedRequestData(["A"], [True], [[]], [([1, 2], [0, 2])], [6]), {"A": 1})
    e = refused(sc, so)
    assert (e.req_id, e.field) == ("A", "new_block_ids"), str(e)
    assert ("group 1: positions [3, 7) (the window of 4 tokens of this step's queries) fall in the null block"
            in str(e)), str(e)


@pytest.mark.parametrize("group1, words", [
    (np.array([], dtype=np.uint64), "group 1: 0 blocks of 4 tokens cannot hold seq_len 7"),
    (np.array([1, 2**32], dtype=np.uint64), "group 1: block ids must be a list of ints, got array("),
    (np.array([1, 2], dtype=np.uint64), None),
])
def test_uint64_replacement_lists(group1, words):
    """numpy ``uint64`` block lists (what a numpy scheduler may send): empty, too large, fine."""
    sc = two_groups()
    so = SchedulerOutput([], CachedRequestData(["A"], [True], [[]], [(np.array([1, 2]), group1)], [6]), {"A": 1})
    if words is None:
        sc.update_states(so)
        assert sc.input_batch.block_table[1].block_table_np[0, :2].tolist() == [1, 2]
        return
    e = refused(sc, so)
    assert (e.req_id, e.field) == ("A", "new_block_ids") and words in str(e), str(e)


@pytest.mark.parametrize("seed, ok", [(-2**63, True), (2**64 - 1, True), (-2**63 - 1, False), (2**64, False)])
def test_seed_bounds(seed, ok):
    sc = two_groups()
    so = new("S", ([3], [4]), sampling_params=SamplingParams(seed=seed, temperature=1.0))
    if ok:
        sc.update_states(so)
        assert sc.requests["S"].generator is not None
    else:
        e = refused(sc, so)
        assert (e.req_id, e.field) == ("S", "sampling_params"), str(e)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("top_k, ok", [(2**31 - 1, True), (100, True), (-2**31, True), (2**31, False),
                                       (-2**31 - 1, False)])
def test_top_k_bounds_are_int32s(native, top_k, ok):
    """Any ``int32`` ``top_k`` is taken (the batch column is ``int32``; ``<= 0`` disables it)."""
    sc = two_groups(native)
    so = new("K", ([3], [4]), sampling_params=SamplingParams(top_k=top_k, temperature=1.0))
    if ok:
        sc.update_states(so)
        assert sc.input_batch.top_k[sc.input_batch.req_id_to_index["K"]] == top_k
    else:
        e = refused(sc, so)
        assert (e.req_id, e.field) == ("K", "sampling_params"), str(e)
        assert str(e).endswith(f"top_k must be an int32 (<= 0 disables it), got {top_k}"), str(e)


@pytest.mark.parametrize("native", [False, True])
def test_a_new_request_without_its_state_slot_names_the_state_group(native):
    """A Mamba group's request needs its one state slot from its first step: an empty list
    is refused with words of its own (not "the block table is too short")."""
    from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
    from attnplug.cache_groups.specs import FullAttentionSpec, MambaSpec

    cfg = KVCacheConfig(16, (KVCacheGroupSpec(("attn",), FullAttentionSpec(block_size=4)),
                             KVCacheGroupSpec(("mamba",), MambaSpec(block_size=32))), num_state_slots=4)
    sc = StepCompiler(cfg, max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, native=native)
    e = refused(sc, new("M", ([3], [])))
    assert (e.req_id, e.field) == ("M", "block_ids"), str(e)
    assert str(e).endswith("group 1: a Mamba state group's request needs its state slot (one block id) from its "
                           "first step; got none"), str(e)


def test_sampling_params_of_another_type_is_refused_naming_the_field():
    e = refused(two_groups(), new("S", ([3], [4]), sampling_params={"temperature": 1.0}))
    assert (e.req_id, e.field) == ("S", "sampling_params") and "expected SamplingParams, got dict" in str(e)


@pytest.mark.parametrize("native", [False, True])
def test_drafts_for_a_row_whose_new_token_arrives_in_the_same_output(native):
    """A's sampled token comes in ``new_token_ids`` (as when the scheduler, not the runner,
    appends it): A then holds 8 tokens, 7 computed: one left, so drafts are fine; with 6
    computed two are left and the drafts are refused."""
    sc = two_groups(native)
    cd = CachedRequestData(["A"], [False], [[8]], [None], [6])
    so = SchedulerOutput([], cd, {"A": 3}, scheduled_spec_decode_tokens={"A": [1, 2]})
    e = refused(sc, so)
    assert (e.req_id, e.field) == ("A", "scheduled_spec_decode_tokens")
    assert "row still prefilling: 2 real tokens left to compute (num_computed_tokens=6 of 8)" in str(e), str(e)
    cd = CachedRequestData(["A"], [False], [[8]], [([3], [3])], [7])
    sc.update_states(SchedulerOutput([], cd, {"A": 3}, scheduled_spec_decode_tokens={"A": [1, 2]}))
    r = sc.input_batch.req_id_to_index["A"]
    assert sc.input_batch.num_tokens[r] == 8 and sc.input_batch.num_spec_tokens[r] == 2


def test_request_state_repr_says_where_the_request_is():
    sc = two_groups()
    st = sc.requests["A"]
    head = "CachedRequestState('A', num_prompt_tokens=6, num_tokens=7, num_computed_tokens="
    assert repr(st) == f"{head}{st.num_computed_tokens}, row 0)"
    sc.update_states(SchedulerOutput([], CachedRequestData(), {}))  # unscheduled: detached
    assert st.row is None and repr(st) == f"{head}{st.num_computed_tokens}, not in batch)"


def one_group(native: bool) -> StepCompiler:
    """One full-attention group (block 4): A holds 7 tokens (6 computed), B 3 (2 computed)."""
    sc = StepCompiler([4], max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, num_blocks=16, native=native)
    so = SchedulerOutput([NewRequestData("A", [1, 2, 3, 4, 5, 6], ([1, 2],)), NewRequestData("B", [7, 8], ([3],))],
                         CachedRequestData(), {"A": 6, "B": 2})
    sc.update_states(so)
    sc.prepare_inputs(so)
    sc.append_output_tokens(["A", "B"], [9, 10])
    return sc


def cached(ids, ncc, tokens=None, blocks=None) -> CachedRequestData:
    n = len(ids)
    return CachedRequestData(list(ids), [False] * n, tokens or [[] for _ in ids], blocks or [None] * n, list(ncc))


@pytest.mark.parametrize("native", [False, True])
def test_counts_listed_in_another_order_than_the_requests(native):
    """``num_scheduled_tokens`` is a dict: its order need not follow the deltas'."""
    sc = one_group(native)
    for order in (["M", "N", "B", "A"], ["A", "B", "M", "N"]):  # all shuffled; only the new ones swapped
        sc = one_group(native)
        counts = {"A": 1, "B": 1, "N": 3, "M": 1}
        so = SchedulerOutput([NewRequestData("N", [5, 5, 5], ([4],)), NewRequestData("M", [6], ([5],))],
                             cached(["A", "B"], [6, 2]), {rid: counts[rid] for rid in order})
        sc.update_states(so)
        b = sc.input_batch
        got = {rid: int(b.num_scheduled_tokens[b.req_id_to_index[rid]]) for rid in "ABNM"}
        assert got == counts, order


@pytest.mark.parametrize("native", [False, True])
def test_a_wrong_total_is_refused_on_both_paths(native):
    sc = one_group(native)
    so = SchedulerOutput([], cached(["A", "B"], [6, 2]), {"A": 1, "B": 1})
    so.total_num_scheduled_tokens = 3
    e = refused(sc, so)
    assert e.field == "total_num_scheduled_tokens" and "is 3 but the entries of" in str(e), str(e)


def test_a_regular_step_with_a_one_token_new_request_takes_the_compiled_scan():
    from attnplug.runner.step.fast import NATIVE
    if NATIVE is None:
        pytest.skip("the compiled scan is not built")
    sc = one_group(True)
    so = SchedulerOutput([NewRequestData("N", [5], ([4],))], cached(["A", "B"], [6, 2]), {"A": 1, "B": 1, "N": 1})
    plan = sc.checker.plan(so)
    assert sc.checker.last_scanned, "a one-token new request is regular"
    sc.apply(plan)
    assert sc.input_batch.num_tokens[sc.input_batch.req_id_to_index["N"]] == 1


@pytest.mark.parametrize("native", [False, True])
def test_cached_request_refusals_name_the_field_and_words(native):
    sc = one_group(native)
    cases = [
        (SchedulerOutput([], cached(["Z"], [0]), {"Z": 1}), ("Z", "scheduled_cached_reqs"),
         "unknown request: send it in scheduled_new_reqs first"),
        (SchedulerOutput([], cached(["A"], [6]), {"A": 1}, finished_req_ids={"A"}), ("A", "finished_req_ids"),
         "request is both finished and scheduled in this step"),
        (SchedulerOutput([], cached(["A", "B"], [6, 2], tokens=[[], [2**31]]), {"A": 1, "B": 2}),
         ("B", "new_token_ids"), "token ids must be ints in [0, 2**31)"),
        (SchedulerOutput([], cached(["A", "B"], [6, 2]), {"A": 1, "B": 3}), ("B", "num_scheduled_tokens"),
         "schedules positions [2, 5) but the request holds only 3 tokens (send new tokens in new_token_ids)"),
        (SchedulerOutput([], cached(["A", "B"], [6, 2**63]), {"A": 1, "B": 1}), ("B", "num_computed_tokens"), ""),
        (SchedulerOutput([], cached(["A", "B"], [6, 2], tokens=[[], [1] * 30]), {"A": 1, "B": 1}),
         ("B", "new_token_ids"), "request would hold 33 tokens but max_model_len is 32"),
        (SchedulerOutput([], CachedRequestData(["A"], [False], [[]], [5], [6]), {"A": 1}), ("A", "new_block_ids"),
         "expected one block-id list per cache group (1), got 5"),
        (SchedulerOutput([], CachedRequestData(["A"], [True], [[]], [None], [0]), {"A": 1}), ("A", "new_block_ids"),
         "group 0: 0 blocks of 4 tokens cannot hold seq_len 1 (num_computed_tokens + num_scheduled_tokens); "
         "the block table is too short"),
        (SchedulerOutput([], CachedRequestData(["A"], [False], [[]], [np.array([3, 4])], [6]), {"A": 1}),
         ("A", "new_block_ids"), "expected one block-id list per cache group (1), got array([3, 4])"),
        (SchedulerOutput([NewRequestData("N", [], ([4],))], cached(["A"], [6]), {"A": 1, "N": 1}),
         ("N", "prompt_token_ids"), "prompt is empty; a request needs at least one token"),
    ]
    for so, (rid, field), words in cases:
        e = refused(sc, so)
        assert (e.req_id, e.field) == (rid, field) and str(e).endswith(words), str(e)
    so = SchedulerOutput([], CachedRequestData([["A"]], [False], [[]], [None], [6]), {"A": 1})
    e = refused(sc, so)
    assert e.field == "scheduled_cached_reqs.req_ids" and "request ids must be str, got list" in str(e), str(e)


def test_a_new_request_may_hold_exactly_the_most_blocks():
    sc = one_group(False)  # max_model_len 32, block 4: at most 8 blocks
    so = SchedulerOutput([NewRequestData("N", [5] * 30, ([4, 5, 6, 7, 8, 9, 10, 11],))], cached(["A"], [6]),
                         {"A": 1, "N": 9})
    sc.update_states(so)
    assert sc.input_batch.block_table[0].num_blocks_per_row[sc.input_batch.req_id_to_index["N"]] == 8


def test_a_null_block_in_a_window_of_unknown_width_names_the_positions_only():
    """A sliding-window group whose width the compiler is not told: every position of the
    step's queries must be in a real block, and the message claims no window."""
    sc = StepCompiler([4, 4], max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, num_blocks=16,
                      group_kinds=["full_attention", "sliding_window"], native=False)
    so = SchedulerOutput([NewRequestData("A", [1, 2, 3, 4, 5, 6], ([1, 2], [0, 2]))], CachedRequestData(), {"A": 6})
    e = refused(sc, so)
    assert (e.req_id, e.field) == ("A", "block_ids")
    assert str(e).endswith("group 1: positions [0, 6) fall in the null block; only blocks no query can see may be "
                           "null"), str(e)


def test_a_total_given_to_the_constructor_is_kept_and_checked():
    """``SchedulerOutput`` fills ``total_num_scheduled_tokens`` only when it is not given:
    a wrong one given is the scheduler's bug, and stage 1 refuses it."""
    so = SchedulerOutput([], cached(["A", "B"], [6, 2]), {"A": 1, "B": 1}, total_num_scheduled_tokens=5)
    assert so.total_num_scheduled_tokens == 5
    assert SchedulerOutput([], cached(["A"], [6]), {"A": 1}).total_num_scheduled_tokens == 1
    e = refused(one_group(False), so)
    assert e.field == "total_num_scheduled_tokens"


def test_fields_of_the_wrong_type_name_themselves():
    sc = one_group(False)
    cd = cached(["A"], [6])
    cd.num_computed_tokens = 7  # not a list
    e = refused(sc, SchedulerOutput([], cd, {"A": 1}))
    assert e.field == "scheduled_cached_reqs.num_computed_tokens" and str(e).endswith("expected a list, got 7"), str(e)
    nr = NewRequestData("N", [5], ([4],))
    nr.output_token_ids = "abc"
    e = refused(sc, SchedulerOutput([nr], cached(["A"], [6]), {"A": 1, "N": 1}))
    assert (e.req_id, e.field) == ("N", "output_token_ids"), str(e)
    nr = NewRequestData("N", [5, 6], ([4],))
    nr.output_token_ids = np.array([6])  # a 1-D integer array is a token list
    nr.num_computed_tokens = 0
    sc.update_states(SchedulerOutput([nr], cached(["A"], [6]), {"A": 1, "N": 2}))


@pytest.mark.parametrize("env, want", [("1", True), ("0", False), (None, False)])
def test_validate_defaults_to_the_environment(monkeypatch, env, want):
    if env is None:
        monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
    else:
        monkeypatch.setenv("ATTNPLUG_VALIDATE", env)
    assert StepCompiler([4], max_num_reqs=2, max_model_len=8, max_num_batched_tokens=8, num_blocks=8).validate is want
    assert StepCompiler([4], max_num_reqs=2, max_model_len=8, max_num_batched_tokens=8, num_blocks=8,
                        validate=not want).validate is (not want)


def test_top_level_fields_of_the_wrong_type_name_the_field_and_type():
    sc = one_group(False)
    e = refused(sc, "not an output")
    assert e.field == "scheduler_output" and str(e).endswith("expected SchedulerOutput, got str"), str(e)
    so = SchedulerOutput([], cached(["A"], [6]), {"A": 1})
    so.num_scheduled_tokens = [("A", 1)]
    e = refused(sc, so)
    assert e.field == "num_scheduled_tokens" and str(e).endswith("expected a dict {req_id: int}, got list"), str(e)
    so = SchedulerOutput([], cached(["A"], [6]), {"A": 1}, scheduled_spec_decode_tokens=[("A", [1])])
    e = refused(sc, so)
    assert e.field == "scheduled_spec_decode_tokens" and "expected a dict {req_id: [draft token ids]}" in str(e), str(e)
    so = SchedulerOutput([], cached(["A"], [6]), {"A": 1}, finished_req_ids=[["A"]])  # a list is not hashable
    e = refused(sc, so)
    assert e.field == "finished_req_ids" and str(e).endswith("request ids must be str, got ['A']"), str(e)


def test_a_long_bad_value_is_echoed_truncated():
    from attnplug.runner.step.check.types import MAX_ECHO
    sc = one_group(False)
    nr = NewRequestData("N", "x" * 1000, ([4],))
    e = refused(sc, SchedulerOutput([nr], cached(["A"], [6]), {"A": 1, "N": 1}))
    assert (e.req_id, e.field) == ("N", "prompt_token_ids"), str(e)
    assert str(e).endswith("... (1002 characters)") and len(str(e)) < MAX_ECHO + 150, str(e)


def test_new_request_block_ids_out_of_range_name_their_group():
    sc = two_groups(False)
    e = refused(sc, new("N", ([3], [-1])))
    assert (e.req_id, e.field) == ("N", "block_ids") and str(e).endswith(
        "group 1: block ids must be ints in [0, 2**31)"), str(e)


def test_scheduling_past_the_held_tokens_names_the_count_not_the_computed():
    sc = one_group(False)  # A holds 7 tokens
    e = refused(sc, SchedulerOutput([], cached(["A"], [7]), {"A": 1}))
    assert (e.req_id, e.field) == ("A", "num_scheduled_tokens"), str(e)


def test_kernel_block_sizes_need_one_per_group():
    from attnplug.core.errors import KVCacheSpecError
    with pytest.raises(KVCacheSpecError, match=r"kernel_block_sizes \[4\]: need one per cache group \(2\)"):
        StepCompiler([4, 8], max_num_reqs=2, max_model_len=8, max_num_batched_tokens=8, num_blocks=8,
                     kernel_block_sizes=[4])


def test_cached_lists_of_different_lengths_name_the_list():
    sc = one_group(False)
    cd = cached(["A", "B"], [6, 2])
    cd.new_token_ids = [[]]  # one entry for two requests
    e = refused(sc, SchedulerOutput([], cd, {"A": 1, "B": 1}))
    assert e.field == "scheduled_cached_reqs.new_token_ids" and str(e).endswith(
        "has 1 entries for 2 req_ids: every list needs one entry per cached request"), str(e)


def test_the_largest_float32_temperature_is_accepted():
    from attnplug.runner.step.check.new import FLOAT32_MAX
    sc = one_group(False)
    sp = SamplingParams(temperature=FLOAT32_MAX)
    sc.update_states(SchedulerOutput([NewRequestData("T", [5], ([4],), sampling_params=sp)], cached(["A"], [6]),
                                     {"A": 1, "T": 1}))
    assert "T" in sc.requests


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("where", ["prompt_token_ids", "new_token_ids", "new_block_ids"])
def test_a_bool_tensor_token_or_block_id_is_refused_like_a_bool(native, where):
    """``struct`` (``operator.index``) takes a one-element bool tensor as 0 or 1: the packer's
    and ``int64_list``'s bool search refuse it like ``True`` (their shared rule, stages 1 and 8)."""
    import torch
    sc = two_groups(native)
    t = torch.tensor(True)
    if where == "prompt_token_ids":
        so = SchedulerOutput([NewRequestData("B", [5, t, 6], ([3], [3]))], CachedRequestData(), {"B": 3})
    elif where == "new_token_ids":
        so = SchedulerOutput([], CachedRequestData(["A"], [False], [[t]], [None], [6]), {"A": 2})
    else:
        so = SchedulerOutput([], CachedRequestData(["A"], [False], [[]], [([t], [3])], [6]), {"A": 1})
    e = refused(sc, so)
    assert e.field == where and "must be ints" in str(e), str(e)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("ncts", [np.int64(2), np.uint8(2), 1.5, "2", True])
def test_a_new_requests_num_computed_tokens_is_an_int_of_any_kind(native, ncts):
    """A numpy integer is taken as its value; a float, a str, a bool are refused by name."""
    sc = StepCompiler([4], 2, 32, 16, native=native)
    so = SchedulerOutput([NewRequestData("n", list(range(6)), ([1, 2],), ncts)], CachedRequestData(), {"n": 4})
    if isinstance(ncts, np.integer):
        sc.update_states(so)
        assert sc.prepare_inputs(so).positions.tolist() == [2, 3, 4, 5]
        return
    e = refused(sc, so)
    assert str(e) == f"request 'n': num_computed_tokens: must be an int >= 0, got {ncts!r}"
