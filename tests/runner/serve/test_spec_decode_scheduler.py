"""The scheduler's side of speculative decoding, without a model: drafts only for decoding
requests, capped by the budget (1 + d tokens), by max_tokens / max_model_len (d <= what
the request may still emit - 1); blocks for the optimistic length and the rolled-back
count in the next delta; under preemption drafts go only to scheduled running requests;
a request emitting more than 1 + d tokens is refused and nothing changes."""

from __future__ import annotations

import pytest

from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core.errors import SchedulingError
from attnplug.runner.execute.spec_decode.drafter import parse_speculative
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
from attnplug.runner.step.scheduler_output import SamplingParams
from attnplug.runner.step.packed_deltas import draft_tokens

PERIODIC = [3, 4, 5] * 4  # the n-gram drafter always finds a continuation


def make(budget=16, max_model_len=64, k=3, num_blocks=64) -> Scheduler:
    kv = KVCacheConfig(num_blocks, (KVCacheGroupSpec(("l0",), FullAttentionSpec(block_size=4)),))
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=max_model_len,
                          speculative=parse_speculative(f"ngram:k={k}"))
    return Scheduler(cfg, kv)


def step(s: Scheduler, emit) -> object:
    """One schedule + update; ``emit(req, drafts)`` gives the tokens a request emits."""
    out = s.schedule()
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        req = s.get_request(rid)
        if req.num_computed_tokens + n >= req.num_tokens:
            sampled[rid] = emit(req, draft_tokens(out).get(rid, []))
    s.update_from_output(out, sampled)
    return out


def test_drafts_only_when_decoding_and_capped_by_budget_and_max_tokens():
    s = make(budget=6)
    s.add_request("a", PERIODIC, SamplingParams(max_tokens=6))
    s.add_request("b", PERIODIC, SamplingParams(max_tokens=20))
    out = step(s, lambda r, d: d + [3])
    assert draft_tokens(out) == {}  # prefill: no drafts
    seen = []
    while s.has_unfinished_requests():
        out = step(s, lambda r, d: d + [3])  # every draft accepted
        for rid, d in draft_tokens(out).items():
            req = s.get_request(rid)
            assert out.num_scheduled_tokens[rid] == 1 + len(d) and len(d) <= 3
            seen.append(len(d))
        assert out.total_num_scheduled_tokens <= 6
    assert len(s.get_request("a").output_token_ids) == 6 and len(s.get_request("b").output_token_ids) == 20
    assert max(seen) == 3 and min(seen) < 3  # the budget (6 = 4 + 2) and max_tokens trimmed some


def test_blocks_cover_the_optimistic_length_and_rollback_keeps_them():
    s = make()
    s.add_request("a", PERIODIC, SamplingParams(max_tokens=30))
    step(s, lambda r, d: [3])
    out = step(s, lambda r, d: [9])  # every draft rejected: one corrected token
    req = s.get_request("a")
    d = draft_tokens(out)["a"]
    assert len(d) == 3
    assert len(req.block_ids[0]) * 4 >= 12 + 1 + 3  # blocks for num_computed + 1 + d
    assert req.num_computed_tokens == 13 and req.num_tokens == 14  # rolled back by 3
    out = s.schedule()
    cached = out.scheduled_cached_reqs
    assert cached.num_computed_tokens[cached.req_ids.index("a")] == 13  # the corrected count goes out


def test_too_many_tokens_for_the_drafts_is_refused_and_changes_nothing():
    s = make()
    s.add_request("a", PERIODIC, SamplingParams(max_tokens=30))
    step(s, lambda r, d: [3])
    out = s.schedule()
    d = draft_tokens(out)["a"]
    req = s.get_request("a")
    before = (req.num_computed_tokens, list(req.output_token_ids))
    with pytest.raises(SchedulingError, match="at most 1 \\+ drafts"):
        s.update_from_output(out, {"a": d + [1, 2]})
    assert (req.num_computed_tokens, list(req.output_token_ids)) == before
    s.update_from_output(out, {"a": d + [1]})
    assert req.num_computed_tokens == 12 + 1 + len(d)


def test_a_preempted_victim_loses_its_drafts():
    s = make(budget=32, num_blocks=9)  # 8 blocks of 4: the two requests cannot both finish at once
    s.add_request("a", PERIODIC, SamplingParams(max_tokens=12))
    s.add_request("b", PERIODIC, SamplingParams(max_tokens=12))
    while s.has_unfinished_requests():
        out = s.schedule()
        for rid, d in draft_tokens(out).items():  # only scheduled, running requests
            assert out.num_scheduled_tokens[rid] == 1 + len(d) and s.get_request(rid).status.value == "running"
        sampled = {rid: draft_tokens(out).get(rid, []) + [3]
                   for rid, n in out.num_scheduled_tokens.items()
                   if s.get_request(rid).num_computed_tokens + n >= s.get_request(rid).num_tokens}
        s.update_from_output(out, sampled)
    assert s.num_preemptions > 0
    assert all(len(s.get_request(r).output_token_ids) == 12 for r in ("a", "b"))
