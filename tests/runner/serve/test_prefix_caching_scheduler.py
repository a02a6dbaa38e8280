"""Prefix caching in the scheduler (runner/serve/kv_cache_manager.py): admissions with
``num_computed_tokens > 0``, blocks shared across requests, sliding-window hits with null
blocks, preemption, and the pools returning to full."""

from __future__ import annotations

from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
from attnplug.cache_groups.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.runner.serve.kv_cache_manager import PrefixCachingKVCacheManager
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
from attnplug.runner.step.scheduler_output import SamplingParams

B = 4


def _sched(groups, num_blocks=64, budget=64, **kw) -> Scheduler:
    kv = KVCacheConfig(num_blocks, tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(groups)))
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=128,
                                     enable_prefix_caching=True, **kw), kv)


def _finish_step(s: Scheduler, out) -> None:
    sampled = {rid: [7] for rid, n in out.num_scheduled_tokens.items()
               if s.get_request(rid).num_computed_tokens + n >= s.get_request(rid).num_tokens}
    s.update_from_output(out, sampled)


def test_a_second_request_starts_from_the_shared_blocks_of_the_first():
    s = _sched([FullAttentionSpec(block_size=B)])
    system = list(range(10, 22))  # 12 tokens: three full blocks
    s.add_request("a", system + [1, 2, 3], SamplingParams(max_tokens=4))
    _finish_step(s, s.schedule())
    s.add_request("b", system + [5, 6], SamplingParams(max_tokens=4))
    out = s.schedule()
    (nb,) = out.scheduled_new_reqs
    a_blocks = s.get_request("a").block_ids[0]
    assert nb.req_id == "b" and nb.num_computed_tokens == 12
    assert nb.block_ids[0][:3] == a_blocks[:3]  # the same physical blocks
    assert out.num_scheduled_tokens["b"] == 2
    kv = s.kv_cache_manager
    assert all(kv.pools[0].blocks[b].ref_cnt == 2 for b in a_blocks[:3])
    assert kv.stats.hits == 12 and kv.stats.hit_requests == 1


def test_the_hit_leaves_the_last_token_to_compute_and_whole_prompt_repeats_hit_all_but_one_block():
    s = _sched([FullAttentionSpec(block_size=B)])
    p = list(range(30, 46))  # 16 tokens: four full blocks
    s.add_request("a", p, SamplingParams(max_tokens=1))
    _finish_step(s, s.schedule())
    s.add_request("b", list(p), SamplingParams(max_tokens=1))
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12  # at most num_tokens - 1, whole blocks
    assert out.num_scheduled_tokens["b"] == 4


def test_sliding_window_hits_need_only_the_window_and_send_null_blocks_before_it():
    s = _sched([FullAttentionSpec(block_size=B), SlidingWindowSpec(block_size=B, sliding_window=5)])
    system = list(range(40, 60))  # 20 tokens: five blocks
    s.add_request("a", system + [1], SamplingParams(max_tokens=2))
    _finish_step(s, s.schedule())
    s.add_request("b", system + [9, 9], SamplingParams(max_tokens=2))
    nb = s.schedule().scheduled_new_reqs[0]
    assert nb.num_computed_tokens == 20
    full, window = nb.block_ids
    assert NULL_BLOCK_ID not in full[:5]
    # W = 5: a query at 20 sees keys 16..20, i.e. block 4 only (cdiv(W - 1, B) = 1 block before it)
    assert window[:4] == [NULL_BLOCK_ID] * 4 and window[4] != NULL_BLOCK_ID


def test_a_preempted_request_keeps_its_blocks_findable_and_hits_them_when_resumed():
    s = _sched([FullAttentionSpec(block_size=B)])
    s.add_request("a", list(range(100, 118)), SamplingParams(max_tokens=8))
    s.add_request("b", list(range(200, 205)), SamplingParams(max_tokens=8))
    _finish_step(s, s.schedule())
    _finish_step(s, s.schedule())
    s.preempt("b")
    s.preempt("a")
    kv = s.kv_cache_manager
    assert kv.num_used_blocks_per_group == [0] and kv.pools[0].num_cached_blocks >= 4
    out = s.schedule()
    resumed = dict(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
    assert out.scheduled_cached_reqs.resumed_from_preemption == [True, True]
    # 20 tokens held (18 prompt + 2 outputs), 19 computed: 4 full blocks of its old list
    assert resumed["a"] == 16 and out.num_scheduled_tokens["a"] == 4


def test_finishing_everything_returns_every_pool_to_full_and_refcounts_to_zero():
    s = _sched([FullAttentionSpec(block_size=B), SlidingWindowSpec(block_size=B, sliding_window=6)],
               num_blocks=24, budget=16, force_preemption_every=3)
    system = list(range(60, 76))
    for i in range(6):
        s.add_request(f"r{i}", system[: 8 + 2 * i] + [i] * (3 + i), SamplingParams(max_tokens=5))
    while s.has_unfinished_requests():
        _finish_step(s, s.schedule())
    kv = s.kv_cache_manager
    assert kv.stats.hit_requests >= 2 and s.num_preemptions >= 1
    for p in kv.pools:
        assert p.num_free_blocks == p.capacity and p.num_used_blocks == 0
        assert all(b.ref_cnt == 0 for b in p.blocks)


def test_without_prefix_caching_nothing_hits():
    kv = KVCacheConfig(32, (KVCacheGroupSpec(("l0",), FullAttentionSpec(block_size=B)),))
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128), kv)
    p = list(range(10, 30))
    s.add_request("a", p, SamplingParams(max_tokens=2))
    _finish_step(s, s.schedule())
    s.add_request("b", list(p), SamplingParams(max_tokens=2))
    assert s.schedule().scheduled_new_reqs[0].num_computed_tokens == 0


def _hybrid(bm: int) -> Scheduler:
    kv = KVCacheConfig(64, (KVCacheGroupSpec(("attn",), FullAttentionSpec(block_size=B)),
                            KVCacheGroupSpec(("mamba",), MambaSpec(block_size=128))), num_state_slots=16)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, enable_prefix_caching=True), kv)
    s.kv_cache_manager = PrefixCachingKVCacheManager(kv, mamba_block_size=bm)
    return s


def test_mamba_hits_restore_a_checkpoint_saved_at_a_block_multiple_and_fall_back_mid_block():
    s = _hybrid(8)
    shared = list(range(10, 40))  # 30 tokens: the prefix ends mid Mamba block (boundaries 8, 16, 24, 32)
    s.add_request("a", shared, SamplingParams(max_tokens=3))
    out = s.schedule()
    assert out.num_scheduled_tokens["a"] == 24  # the chunk is cut at the last multiple of 8 inside it
    (g, src, ckpt), = out.mamba_state_copies.saves
    assert g == 1 and src == out.scheduled_new_reqs[0].block_ids[1][0] and ckpt != src
    _finish_step(s, out)
    out = s.schedule()
    assert out.num_scheduled_tokens["a"] == 6 and not out.mamba_state_copies.saves  # 30: no boundary
    _finish_step(s, out)
    s.add_request("b", shared + [1, 2, 3], SamplingParams(max_tokens=3))
    out = s.schedule()
    nb = out.scheduled_new_reqs[0]
    # attention could hit 28 tokens (7 blocks of 4) but the Mamba state exists only after 24
    assert nb.num_computed_tokens == 24
    (g, src, dst), = out.mamba_state_copies.restores
    assert (g, src) == (1, ckpt) and dst == nb.block_ids[1][0] != ckpt
    kv = s.kv_cache_manager
    assert kv.pools[1].blocks[ckpt].ref_cnt == 1  # held for the step, released when it is applied
    _finish_step(s, out)
    assert kv.pools[1].blocks[ckpt].ref_cnt == 0 and kv.pools[1].get_cached_block(
        kv.pools[1].blocks[ckpt].block_hash) == ckpt


def test_mamba_checkpoints_are_off_with_async_scheduling():
    kv = KVCacheConfig(64, (KVCacheGroupSpec(("attn",), FullAttentionSpec(block_size=B)),
                            KVCacheGroupSpec(("mamba",), MambaSpec(block_size=128))))
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, enable_prefix_caching=True,
                                  async_scheduling=True), kv)
    assert "synchronous" in s.kv_cache_manager.disabled_reason
