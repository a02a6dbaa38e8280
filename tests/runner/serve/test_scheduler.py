"""Scheduler: budgets, chunked prefill, ordering, preemption, finishing, and the deltas it emits.

A ``Mirror`` applies every ``SchedulerOutput`` the way a runner would (it only ever sees
the deltas) and is checked against the scheduler's own view after each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec, cdiv
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import InvalidRequestError, SchedulingError
from attnplug.runner.serve.request import RequestStatus
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
from attnplug.runner.step.scheduler_output import SamplingParams, SchedulerOutput
from attnplug.runner.step.packed_deltas import as_vllm_form


def kv_config(num_blocks, *specs):
    specs = specs or (FullAttentionSpec(block_size=4),)
    return KVCacheConfig(num_blocks, tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)))


def make(num_blocks=64, *specs, **cfg):
    cfg.setdefault("max_num_batched_tokens", 16)
    cfg.setdefault("max_model_len", 128)
    return Scheduler(SchedulerConfig(**cfg), kv_config(num_blocks, *specs))


@dataclass
class RunnerState:
    tokens: list[int]
    num_computed_tokens: int
    block_ids: list[list[int]]


@dataclass
class Mirror:
    """What a runner holds, built from the deltas alone."""

    reqs: dict[str, RunnerState] = field(default_factory=dict)

    def apply(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            del self.reqs[rid]
        for nr in out.scheduled_new_reqs:
            assert nr.req_id not in self.reqs and nr.num_computed_tokens == 0 and not nr.output_token_ids
            self.reqs[nr.req_id] = RunnerState(list(nr.prompt_token_ids), 0, [list(b) for b in nr.block_ids])
        c = as_vllm_form(out).scheduled_cached_reqs  # (the scheduler packs its appends)
        assert len({len(c.req_ids), len(c.resumed_from_preemption), len(c.new_token_ids),
                    len(c.new_block_ids), len(c.num_computed_tokens)}) == 1
        for i, rid in enumerate(c.req_ids):
            s = self.reqs[rid]
            assert c.new_token_ids[i] == []
            if c.resumed_from_preemption[i]:
                assert c.num_computed_tokens[i] == 0 and c.new_block_ids[i] is not None
                s.block_ids = [list(b) for b in c.new_block_ids[i]]
            else:
                assert c.num_computed_tokens[i] == s.num_computed_tokens  # no hidden progress
                if c.new_block_ids[i] is not None:
                    for g, ids in enumerate(c.new_block_ids[i]):
                        s.block_ids[g].extend(ids)
            s.num_computed_tokens = c.num_computed_tokens[i]
        scheduled = {nr.req_id for nr in out.scheduled_new_reqs} | set(c.req_ids)
        assert scheduled == set(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())

    def sample(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Advance like the runner and sample a deterministic token for complete requests."""
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            s = self.reqs[rid]
            s.num_computed_tokens += n
            assert s.num_computed_tokens <= len(s.tokens)
            if s.num_computed_tokens == len(s.tokens):
                tok = (len(s.tokens) * 7 + len(rid)) % 101
                s.tokens.append(tok)
                sampled[rid] = [tok]
        return sampled


def check_agrees(sched: Scheduler, mirror: Mirror, out: SchedulerOutput) -> None:
    for rid in out.num_scheduled_tokens:
        req, s = sched.get_request(rid), mirror.reqs[rid]
        assert s.num_computed_tokens == req.num_computed_tokens
        # Sliding-window groups null out blocks no query can see; the runner is not told
        # (its table never shifts and kernels never read them), so compare live entries.
        assert len(s.block_ids) == len(req.block_ids)
        for mine, theirs in zip(s.block_ids, req.block_ids):
            assert len(mine) == len(theirs)
            assert all(t in (NULL_BLOCK_ID, b) for b, t in zip(mine, theirs))
        assert s.tokens == req.all_token_ids


def step(sched: Scheduler, mirror: Mirror):
    out = sched.schedule()
    mirror.apply(out)
    check_agrees(sched, mirror, out)
    finished = sched.update_from_output(out, mirror.sample(out))
    return out, finished


def run_all(sched: Scheduler, mirror: Mirror | None = None, max_steps=10_000, on_step=None):
    mirror = mirror or Mirror()
    outs = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, mirror)
        outs.append(out)
        if on_step:
            on_step(out)
        assert len(outs) < max_steps, "scheduler made no progress"
    return outs


def test_chunked_prefill_splits_prompt_under_budget_then_decodes():
    s = make(max_num_batched_tokens=8, packed_deltas=True)  # (the default only with the compiled kernels)
    s.add_request("a", list(range(20)), SamplingParams(max_tokens=3))
    outs = run_all(s)
    assert [o.num_scheduled_tokens["a"] for o in outs] == [8, 8, 4, 1, 1]
    assert outs[0].scheduled_new_reqs[0].block_ids == ([1, 2],)
    assert outs[1].packed_cached.new_block_ids.tolist() == [3, 4]  # the scheduler packs its appends
    assert outs[1].packed_cached.num_new_blocks.tolist() == [[2]]
    assert as_vllm_form(outs[1]).scheduled_cached_reqs.new_block_ids == [([3, 4],)]
    assert as_vllm_form(outs[2]).scheduled_cached_reqs.new_block_ids == [([5],)]
    assert as_vllm_form(outs[3]).scheduled_cached_reqs.new_block_ids == [([6],)]  # token 20 opens block 5
    assert as_vllm_form(outs[4]).scheduled_cached_reqs.new_block_ids == [None]
    assert s.get_request("a").num_output_tokens == 3
    v = make(max_num_batched_tokens=8, packed_deltas=False)  # vLLM's form asked for
    v.add_request("a", list(range(20)), SamplingParams(max_tokens=3))
    assert [o.scheduled_cached_reqs.new_block_ids for o in run_all(v)[1:]] == [[([3, 4],)], [([5],)], [([6],)], [None]]


def test_new_request_gets_what_is_left_of_the_budget():
    s = make(max_num_batched_tokens=10)
    s.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    s.add_request("b", list(range(30)), SamplingParams(max_tokens=2))
    out, _ = step(s, m := Mirror())
    assert out.num_scheduled_tokens == {"a": 3, "b": 7}
    out, _ = step(s, m)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}


def test_chunked_prefill_disabled_schedules_prompts_whole():
    s = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add_request("a", [1] * 6, SamplingParams(max_tokens=2))
    s.add_request("b", [2] * 6, SamplingParams(max_tokens=2))
    out, _ = step(s, m := Mirror())
    assert out.num_scheduled_tokens == {"a": 6}
    out, _ = step(s, m)
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}
    with pytest.raises(InvalidRequestError, match="chunked prefill disabled"):
        s.add_request("c", [3] * 11)


def test_max_num_seqs_caps_running_requests():
    s = make(max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(4):
        s.add_request(f"r{i}", [i] * 3, SamplingParams(max_tokens=2))
    out, _ = step(s, m := Mirror())
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    assert len(s.running) == 2 and len(s.waiting) == 2
    out, fin = step(s, m)
    assert fin == ["r0", "r1"] and list(out.num_scheduled_tokens) == ["r0", "r1"]
    out, _ = step(s, m)
    assert out.finished_req_ids == {"r0", "r1"}
    assert list(out.num_scheduled_tokens) == ["r2", "r3"]


def test_decodes_are_scheduled_before_prefills():
    s = make(max_num_batched_tokens=10)
    s.add_request("short", [5, 6], SamplingParams(max_tokens=4))
    s.add_request("long", list(range(40)), SamplingParams(max_tokens=2))
    out, _ = step(s, m := Mirror())
    assert out.num_scheduled_tokens == {"short": 2, "long": 8}
    # White-box: put the prefill first in admission order; FIFO over running alone would
    # give it the whole budget and starve the decode.
    s.running.reverse()
    out, _ = step(s, m)
    assert list(out.num_scheduled_tokens.items()) == [("short", 1), ("long", 9)]
    assert out.scheduled_cached_reqs.req_ids == ["short", "long"]


def test_preemption_when_blocks_run_out_and_resume_with_replacement_blocks():
    # 6 usable blocks of 4 tokens; each request grows to 4 blocks.
    s = make(7, max_num_batched_tokens=32)
    s.add_request("a", list(range(10)), SamplingParams(max_tokens=6))
    s.add_request("b", list(range(10)), SamplingParams(max_tokens=6))
    m = Mirror()
    out, _ = step(s, m)
    assert out.num_scheduled_tokens == {"a": 10, "b": 10}
    while s.num_preemptions == 0:
        out, _ = step(s, m)
    assert s.get_request("b").status is RequestStatus.PREEMPTED
    assert s.get_request("b").num_computed_tokens == 0
    assert "b" not in out.num_scheduled_tokens and "b" in m.reqs  # unscheduled, kept by runner
    assert all(not ids for ids in s.get_request("b").block_ids)
    resumed = None
    while resumed is None:
        out, _ = step(s, m)
        c = as_vllm_form(out).scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            if c.resumed_from_preemption[i]:
                resumed = (rid, c.num_computed_tokens[i], c.new_block_ids[i], out.num_scheduled_tokens[rid])
    rid, computed, blocks, n = resumed
    b = s.get_request("b")
    assert rid == "b" and computed == 0
    assert n == b.num_computed_tokens == b.num_tokens - 1  # prompt + generated, recomputed at once
    assert b.num_output_tokens >= 2 and n > 10
    assert list(blocks[0]) == b.block_ids[0] and len(blocks[0]) == cdiv(n, 4)
    run_all(s, m)
    assert all(len(s.get_request(r).output_token_ids) == 6 for r in "ab")
    assert s.kv_cache_manager.num_used_blocks_per_group == [0]


def test_finish_at_max_tokens_frees_blocks_and_reports_once():
    s = make(max_num_batched_tokens=32)
    s.add_request("a", list(range(5)), SamplingParams(max_tokens=2))
    m = Mirror()
    _, fin = step(s, m)
    assert fin == []
    _, fin = step(s, m)
    assert fin == ["a"] and s.get_request("a").is_finished
    assert s.kv_cache_manager.num_used_blocks_per_group == [0]
    assert not s.has_unfinished_requests()
    assert s.schedule().finished_req_ids == {"a"}
    assert s.schedule().finished_req_ids == set()
    assert s.get_request("a").output_token_ids == m.reqs["a"].tokens[5:]


def test_finish_when_length_reaches_max_model_len():
    s = make(max_model_len=8)
    s.add_request("a", list(range(6)), SamplingParams(max_tokens=10))
    run_all(s)
    assert s.get_request("a").num_output_tokens == 2


@pytest.mark.parametrize("prompt, sp, match", [
    ([], None, "empty prompt"),
    (list(range(128)), None, "max_model_len=128"),
    ([1, -2], None, "negative token id"),
    (list(range(100)), SamplingParams(max_tokens=20), "could never finish"),
])
def test_add_request_rejects_bad_requests_without_changes(prompt, sp, match):
    s = make(16)
    s.add_request("ok", [1, 2])
    with pytest.raises(InvalidRequestError, match=match):
        s.add_request("bad", prompt, sp)
    assert list(s.requests) == ["ok"] and len(s.waiting) == 1
    with pytest.raises(InvalidRequestError, match="duplicate"):
        s.add_request("ok", [3])


def test_update_from_output_protocol_errors_change_nothing():
    s = make(max_num_batched_tokens=4)
    s.add_request("a", list(range(6)), SamplingParams(max_tokens=2))
    out = s.schedule()
    with pytest.raises(SchedulingError, match="called again"):
        s.schedule()
    with pytest.raises(SchedulingError, match="partial prefill"):
        s.update_from_output(out, {"a": [1]})
    with pytest.raises(SchedulingError, match="not scheduled"):
        s.update_from_output(out, {"zz": [1]})
    with pytest.raises(SchedulingError, match="during a step"):
        s.preempt("a")
    assert s.get_request("a").num_computed_tokens == 0
    s.update_from_output(out, {})
    out = s.schedule()
    with pytest.raises(SchedulingError, match="no sampled token"):
        s.update_from_output(out, {})
    s.update_from_output(out, {"a": [9]})
    with pytest.raises(SchedulingError, match="already applied"):
        s.update_from_output(out, {"a": [9]})
    assert s.get_request("a").output_token_ids == [9]


def test_forced_preemption_resumes_and_everything_finishes():
    s = make(max_num_batched_tokens=8, force_preemption_every=3)
    for i in range(5):
        s.add_request(f"r{i}", list(range(3 + 4 * i)), SamplingParams(max_tokens=5))
    resumed = []
    run_all(s, on_step=lambda o: resumed.extend(
        r for r, f in zip(o.scheduled_cached_reqs.req_ids, o.scheduled_cached_reqs.resumed_from_preemption) if f))
    assert s.num_preemptions >= 2 and len(resumed) == s.num_preemptions
    assert all(s.get_request(f"r{i}").num_output_tokens == 5 for i in range(5))


def test_sliding_window_group_frees_blocks_on_long_request():
    W, B, budget = 8, 4, 8
    s = make(64, FullAttentionSpec(block_size=B), SlidingWindowSpec(block_size=B, sliding_window=W),
             max_num_batched_tokens=budget, max_model_len=256)
    s.add_request("a", list(range(150)), SamplingParams(max_tokens=30))
    peak = 0

    def on_step(out):
        nonlocal peak
        req = s.get_request("a")
        if req.block_ids[1]:
            peak = max(peak, sum(b != NULL_BLOCK_ID for b in req.block_ids[1]))

    run_all(s, on_step=on_step)
    assert peak <= cdiv(W - 1 + budget, B) + 1
    assert s.peak_blocks_per_group[0] == cdiv(179, B)
    assert s.kv_cache_manager.num_used_blocks_per_group == [0, 0]


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 64))
    reqs = [(draw(st.integers(1, max_model_len - 1)), draw(st.integers(1, 12)))
            for _ in range(draw(st.integers(1, 8)))]
    worst = max(cdiv(min(p + o, max_model_len) - 1, block_size) for p, o in reqs)
    num_blocks = draw(st.integers(worst + 1, worst + 1 + 3 * worst))
    cfg = SchedulerConfig(max_num_batched_tokens=draw(st.integers(1, 32)),
                          max_num_seqs=draw(st.integers(1, 6)), max_model_len=max_model_len,
                          enable_chunked_prefill=True,
                          force_preemption_every=draw(st.sampled_from([None, 2, 5])))
    return cfg, block_size, num_blocks, reqs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_keep_invariants_and_finish(scenario):
    cfg, block_size, num_blocks, reqs = scenario
    s = Scheduler(cfg, kv_config(num_blocks, FullAttentionSpec(block_size=block_size)))
    for i, (p, o) in enumerate(reqs):
        s.add_request(f"r{i}", [(i + j) % 50 for j in range(p)], SamplingParams(max_tokens=o))

    def on_step(out):
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
        owned = [b for r in s.running for b in r.block_ids[0]]
        assert NULL_BLOCK_ID not in owned
        assert len(owned) == len(set(owned)) == s.kv_cache_manager.num_used_blocks_per_group[0]
        for r in s.waiting:
            assert not r.block_ids[0] and r.num_computed_tokens == 0

    outs = run_all(s, on_step=on_step)
    assert all(o.total_num_scheduled_tokens > 0 for o in outs)
    for i, (p, o) in enumerate(reqs):
        req = s.get_request(f"r{i}")
        assert req.is_finished and req.num_output_tokens == min(o, cfg.max_model_len - p)
    assert s.kv_cache_manager.num_used_blocks_per_group == [0]
