"""Rollback after verification: rejected drafts leave nothing that is ever read.

After every step, every K/V slot of every resident request from position
``num_tokens - 1`` on (the last emitted token, not computed yet, and everything after it:
the K/V the rejected drafts wrote, and never-written tail slots) is overwritten with a huge
value in every layer. If any later query read one of those slots, the greedy tokens would
change; they must equal the run without speculation (which equals HF, see
``test_spec_decode_engine.py``). The poison must hit slots that rejected drafts really
wrote (counted), and the runner's token history, ``num_computed_tokens`` and
``seq_lens`` of the next step hold exactly the accepted tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_parity_sliding import GEMMA3  # noqa: E402
from test_spec_decode_engine import LLAMA, engine  # noqa: E402

from attnplug.runner.step.scheduler_output import SamplingParams  # noqa: E402
from attnplug.runner.step.packed_deltas import draft_tokens

POISON = 1e4
PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [1, 2, 3, 1, 2, 3, 1, 2], list(range(20, 34)), [7] * 5]


def poison_dead_slots(eng, written: dict[str, int]) -> int:
    """Poison every slot at or after each resident request's ``num_tokens - 1``; return how
    many of them the last step wrote (``written[req] = its seq_len in that step``)."""
    runner = eng.runner
    hit = 0
    for g, group in enumerate(runner.kv_cache_config.groups):
        B, kbs = group.kv_cache_spec.block_size, runner.kernel_block_sizes[g]
        for rid, st in runner.compiler.requests.items():
            ids = st.block_ids[g]
            start = st.num_tokens - 1
            for p in range(start, len(ids) * B):
                b = ids[p // B]
                if b == 0:
                    continue
                kb, off = b * (B // kbs) + (p % B) // kbs, p % kbs
                for name in group.layer_names:
                    runner.kv_caches[name][kb, :, off] = POISON
                hit += g == 0 and p < written.get(rid, 0)
    return hit


def greedy_run(eng, poison: bool) -> tuple[dict, int]:
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=10))
    hits = 0
    sched = eng.scheduler
    while sched.has_unfinished_requests():
        out = sched.schedule()
        result = eng.runner.execute_model(out)
        eng.stats.num_steps += 1
        eng._apply(out, result)
        rows = eng.runner.compiler.requests
        for rid, drafts in draft_tokens(out).items():
            if rid in rows and not sched.get_request(rid).is_finished:
                # the runner's history holds exactly the emitted tokens, as the scheduler's does
                assert rows[rid].all_token_ids == sched.get_request(rid).all_token_ids
        if poison:
            cached = out.scheduled_cached_reqs
            before = dict(zip(cached.req_ids, cached.num_computed_tokens))
            written = {rid: before[rid] + out.num_scheduled_tokens[rid] for rid in draft_tokens(out)}
            hits += poison_dead_slots(eng, written)
    eng.run()
    return {rid: r.output_token_ids for rid, r in sorted(eng.results.items())}, hits


@pytest.mark.parametrize("cfg", [LLAMA, GEMMA3], ids=["llama", "gemma3"])
def test_no_rejected_draft_kv_is_ever_read(cfg):
    base, _ = greedy_run(engine(None, cfg=cfg), poison=False)
    eng = engine("ngram:k=3", cfg=cfg)
    out, hits = greedy_run(eng, poison=True)
    stats = eng.scheduler.spec.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert hits > 0, "no slot a rejected draft wrote was poisoned"
    assert out == base
