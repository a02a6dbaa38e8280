"""Property test of prefix caching through the scheduler (hypothesis): random shared-prefix
workloads on small pools (so blocks are evicted and requests preempted), with full,
sliding-window and Mamba groups. After every step, in every pool: each block's ``ref_cnt``
is exactly the number of holders (requests listing it, plus Mamba checkpoint slots held
for the step), never negative; a block without a hash is held by at most one request (a
block is never handed out twice); every cached hash maps to its block; and when every
request has finished, every pool is full again with all counts zero."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
from attnplug.cache_groups.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
from attnplug.runner.step.scheduler_output import SamplingParams

B = 4
PREFIXES = [list(range(100, 124)), list(range(200, 211)), list(range(300, 316))]


def _check(s: Scheduler) -> None:
    kv = s.kv_cache_manager
    held_ckpt = Counter((g, slot) for g, slot in (kv.mamba._held if kv.mamba else []))
    for g, (m, pool) in enumerate(zip(kv.managers, kv.pools)):
        holders = Counter()
        for rid, ids in m.req_to_blocks.items():
            real = [b for b in ids if b != NULL_BLOCK_ID]
            assert len(real) == len(set(real)), f"group {g}: {rid} lists a block twice"
            holders.update(real)
        for blk in pool.blocks[1:]:
            assert blk.ref_cnt >= 0
            want = holders[blk.block_id] + held_ckpt[(g, blk.block_id)]
            assert blk.ref_cnt == want, f"group {g} block {blk.block_id}: ref_cnt {blk.ref_cnt}, holders {want}"
            if blk.block_hash is None:
                assert holders[blk.block_id] <= 1, f"group {g}: uncached block {blk.block_id} shared"
        for h, b in pool.cached_block_hash_to_block.items():
            assert pool.blocks[b].block_hash == h
        assert pool.num_used_blocks == sum(1 for blk in pool.blocks if blk.ref_cnt > 0)


request_st = st.tuples(st.integers(0, len(PREFIXES) - 1), st.integers(0, 24), st.integers(1, 6),
                       st.integers(1, 12))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request_st, min_size=2, max_size=9), st.sampled_from(["full", "window", "hybrid"]),
       st.integers(14, 30), st.sampled_from([None, 3]), st.integers(0, 2**16))
def test_refcounts_match_holders_and_everything_returns(reqs, kind, num_blocks, preempt_every, seed):
    specs = {"full": [FullAttentionSpec(block_size=B)],
             "window": [FullAttentionSpec(block_size=B), SlidingWindowSpec(block_size=B, sliding_window=6)],
             "hybrid": [FullAttentionSpec(block_size=B), MambaSpec(block_size=64)]}[kind]
    kv = KVCacheConfig(num_blocks, tuple(KVCacheGroupSpec((f"l{i}",), sp) for i, sp in enumerate(specs)),
                       num_state_slots=12)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=64,
                                  enable_prefix_caching=True, force_preemption_every=preempt_every), kv)
    for i, (p, cut, own, max_tokens) in enumerate(reqs):
        s.add_request(f"r{i}", PREFIXES[p][:cut] + [i + 1] * own, SamplingParams(max_tokens=max_tokens))
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        _check(s)
        sampled = {rid: [(seed + steps + len(rid)) % 50]
                   for rid, n in out.num_scheduled_tokens.items()
                   if s.get_request(rid).num_computed_tokens + n >= s.get_request(rid).num_tokens}
        s.update_from_output(out, sampled)
        _check(s)
        steps += 1
        assert steps < 500
    for pool in s.kv_cache_manager.pools:
        assert pool.num_free_blocks == pool.capacity and all(b.ref_cnt == 0 for b in pool.blocks)
