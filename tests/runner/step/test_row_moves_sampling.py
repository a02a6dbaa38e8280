"""Sampling columns and generators through every row move: swap (two seeded rows), condense
(seeded tail rows into holes), reorder (decodes first), and a hole refilled by an unseeded
request. After each move every row's temperature / top_k / top_p are its request's and
``generators[row]`` is its request's own generator (absent for unseeded rows); checked
directly and through invariant 2 of ``attnplug.core.validate``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from attnplug.core.errors import MetadataInvariantError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.validation import validate
from attnplug.runner.step.apply import reorder_decodes_first
from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.debug import batch_view
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.request_state import CachedRequestState
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput


def _params(i: int, seeded: bool) -> SamplingParams:
    return SamplingParams(temperature=0.25 * (i + 1), top_k=i + 2, top_p=1.0 - 0.0625 * i,
                          seed=100 + i if seeded else None)


def _state(i: int, seeded: bool) -> CachedRequestState:
    return CachedRequestState(f"r{i}", [i] * (i + 2), ([i + 1],), num_computed_tokens=1,
                              sampling_params=_params(i, seeded))


def check(batch: InputBatch, requests: dict[str, CachedRequestState]):
    """Every row's sampling columns and generator are its request's (direct, then validate())."""
    R = batch.num_reqs
    for row, rid in enumerate(batch.req_ids):
        st, sp = requests[rid], requests[rid].sampling_params
        got = (float(batch.temperature[row]), int(batch.top_k[row]), float(batch.top_p[row]))
        assert got == (sp.temperature, sp.top_k, sp.top_p), (rid, row)
        assert batch.generators.get(row) is st.generator, (rid, row)
        assert (st.generator is None) == (sp.seed is None)
    assert set(batch.generators) <= set(range(R))  # no generator left behind in a vacant row
    view = batch_view(batch, requests)
    view = dataclasses.replace(
        view, sampling=(batch.temperature, batch.top_k, batch.top_p), generators=dict(batch.generators),
        states={rid: dataclasses.replace(rs, sampling=_triple(requests[rid]), generator=requests[rid].generator)
                for rid, rs in view.states.items()})
    computed = batch.num_computed_tokens_cpu[:R]
    cm = CommonAttentionMetadata.from_lengths(computed, [1] * R, [[1] * 8] * R, 4)
    validate(cm, batch=view)
    return view, cm


def _triple(st):
    sp = st.sampling_params
    return (sp.temperature, sp.top_k, sp.top_p)


def _batch(n: int, seeded) -> tuple[InputBatch, dict]:
    batch = InputBatch(8, 32, 32, [4])
    states = [_state(i, seeded(i)) for i in range(n)]
    batch.add_requests(states)
    return batch, {st.req_id: st for st in states}


def test_swapping_two_seeded_rows_swaps_their_generators():
    batch, requests = _batch(4, lambda i: True)
    g1, g2 = requests["r1"].generator, requests["r2"].generator
    batch.swap_states(1, 2)
    assert batch.generators[1] is g2 and batch.generators[2] is g1
    check(batch, requests)
    batch.swap_states(0, 3)
    batch.swap_states(3, 3)  # a no-op
    check(batch, requests)


def test_swapping_a_seeded_and_an_unseeded_row():
    batch, requests = _batch(3, lambda i: i == 0)
    batch.swap_states(0, 2)
    assert 0 not in batch.generators and batch.generators[2] is requests["r0"].generator
    check(batch, requests)


def test_condense_moves_seeded_tail_rows_into_holes():
    batch, requests = _batch(7, lambda i: i % 3 != 1)  # r0, r2, r3, r5, r6 seeded
    for rid in ("r1", "r2", "r4"):
        batch.remove_request(rid)
        requests.pop(rid)
    assert batch.condense() == [(6, 1), (5, 2)]
    check(batch, requests)


def test_a_hole_refilled_by_an_unseeded_request_holds_no_generator():
    batch, requests = _batch(3, lambda i: True)
    batch.remove_request("r1")
    requests.pop("r1")
    new = _state(5, seeded=False)
    assert batch.add_request(new) == 1
    requests[new.req_id] = new
    check(batch, requests)


def test_reorder_decodes_first_moves_every_sampling_column():
    batch, requests = _batch(6, lambda i: i in (0, 1, 4, 5))
    batch.num_scheduled_tokens[:6] = [5, 4, 1, 3, 1, 1]  # decodes are rows 2, 4, 5
    swaps = reorder_decodes_first(batch, 1)
    assert swaps == [(0, 5), (1, 4)]
    assert batch.req_ids == ["r5", "r4", "r2", "r3", "r1", "r0"]
    check(batch, requests)


def test_validate_names_a_generator_left_behind():
    batch, requests = _batch(3, lambda i: i != 1)
    view, cm = check(batch, requests)
    g = view.generators
    g[0], g[2] = g[2], g[0]  # what a swap that forgot the generators would leave
    with pytest.raises(MetadataInvariantError, match="generator") as info:
        validate(cm, batch=view)
    assert (info.value.invariant, info.value.row) == ("2 row columns", 0)


def _new(i, seeded, computed=0, n=6):
    return NewRequestData(req_id=f"r{i}", prompt_token_ids=list(range(1, n + 1)), block_ids=([10 + 2 * i, 11 + 2 * i],),
                          num_computed_tokens=computed, sampling_params=_params(i, seeded))


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    NATIVE is None, reason="the compiled extension is not built"))], ids=["numpy", "native"])
def test_steps_that_finish_condense_and_reorder_keep_sampling_with_the_request(native):
    """Through StepCompiler.update_states: requests finish (holes, condense), others are
    reordered decodes-first; after each step every row still has its request's columns."""
    sc = StepCompiler([4], 8, 32, 64, reorder_batch_threshold=1, num_blocks=40, native=native)
    seeded = lambda i: i % 2 == 0  # noqa: E731
    so = SchedulerOutput(scheduled_new_reqs=[_new(i, seeded(i), computed=5 if i % 3 else 0) for i in range(6)],
                         num_scheduled_tokens={f"r{i}": 1 if i % 3 else 6 for i in range(6)})
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    sc.update_states(so)
    assert sc.input_batch.req_ids[:4] != [f"r{i}" for i in range(4)]  # the step did reorder
    check(sc.input_batch, sc.requests)
    # r1 and r2 finish; the other four decode one more token each (holes -> condense, reorder)
    live = ["r0", "r3", "r4", "r5"]
    cached = CachedRequestData(req_ids=live, resumed_from_preemption=[False] * 4, new_token_ids=[[7]] * 4,
                               new_block_ids=[None] * 4, num_computed_tokens=[6] * 4)
    so = SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={r: 1 for r in live},
                         total_num_scheduled_tokens=4, finished_req_ids={"r1", "r2"})
    sc.update_states(so)
    assert sorted(sc.input_batch.req_ids) == live
    check(sc.input_batch, sc.requests)
    assert np.count_nonzero(sc.input_batch.top_k[:4]) == 4
    assert all(isinstance(sc.requests[r].generator, torch.Generator) for r in ("r0", "r4"))


def test_a_given_generator_is_kept_seeded_or_not_and_a_seed_alone_makes_one():
    """``CachedRequestState(generator=...)``: a request that brings its generator (one that
    has drawn already) keeps it, seeded or not; without one, a seed makes a fresh one and no
    seed makes none."""
    g = torch.Generator()
    g.manual_seed(3)
    torch.rand(4, generator=g)  # advanced: a fresh generator of the same seed would differ
    seeded = CachedRequestState("s", [1], ([1],), sampling_params=SamplingParams(seed=3), generator=g)
    unseeded = CachedRequestState("u", [1], ([1],), generator=g)
    assert seeded.generator is g and unseeded.generator is g
    fresh = CachedRequestState("f", [1], ([1],), sampling_params=SamplingParams(seed=3)).generator
    assert fresh is not None and fresh is not g and fresh.initial_seed() == 3
    assert CachedRequestState("n", [1], ([1],)).generator is None
