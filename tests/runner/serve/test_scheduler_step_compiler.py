"""The scheduler's deltas drive the runner's StepCompiler for hundreds of steps.

Under chunked prefill, a tight block pool (preemption by recompute) and forced
preemption, the runner's state, built only from the deltas and its own samples, must
agree with the scheduler's view after every step: token history, num_computed_tokens
and block ids; the eight invariants are checked every step (``validate=True``).
"""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
from attnplug.runner.step.scheduler_output import SamplingParams
from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.commands.traces import load_trace, make_prompts


def agree(sched: Scheduler, sc: StepCompiler, scheduled) -> None:
    """After ``update_states``: the runner's view of every request equals the scheduler's.

    The runner learns ``num_computed_tokens`` from the deltas, so it matches the
    scheduler's value before the step; requests not scheduled this step must still hold
    the same token history (the runner keeps state of unscheduled / preempted requests).
    """
    for rid, st in sc.requests.items():
        req = sched.get_request(rid)
        assert not req.is_finished, f"{rid} finished but still held by the runner"
        assert st.all_token_ids == req.all_token_ids, rid
        if rid in scheduled:
            assert st.num_computed_tokens == req.num_computed_tokens, rid
            assert st.block_ids == tuple(list(b) for b in req.block_ids), rid
            assert st.row is not None
        else:
            assert st.row is None, f"unscheduled {rid} still has a batch row"
    live = {r.req_id for r in sched.running} | {r.req_id for r in sched.waiting if r.sent_to_runner}
    assert live == set(sc.requests)


@pytest.mark.parametrize("force_preemption_every", [None, 7])
def test_scheduler_outputs_drive_step_compiler(force_preemption_every):
    max_model_len, budget, max_seqs = 256, 48, 8
    kv = KVCacheConfig(40, (
        KVCacheGroupSpec(("l0", "l1"), FullAttentionSpec(block_size=8)),
        KVCacheGroupSpec(("l2",), FullAttentionSpec(block_size=16)),
    ))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                      max_model_len=max_model_len,
                                      force_preemption_every=force_preemption_every), kv)
    sc = StepCompiler(kv, max_num_reqs=max_seqs, max_model_len=max_model_len,
                      max_num_batched_tokens=budget, validate=True)
    trace = load_trace("conv", 40, max_model_len=max_model_len, scale=8.0)
    for i, (r, prompt) in enumerate(zip(trace, make_prompts(trace, vocab_size=1000, seed=0))):
        sched.add_request(f"r{i}", prompt, SamplingParams(max_tokens=min(r.output_len, 24)))

    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sc.update_states(out)
        agree(sched, sc, out.num_scheduled_tokens)
        sampled: dict[str, list[int]] = {}
        if out.total_num_scheduled_tokens:
            inputs = sc.prepare_inputs(out)
            assert inputs.num_actual_tokens == out.total_num_scheduled_tokens <= budget
            keep = np.flatnonzero(~inputs.discard)
            ids = [inputs.req_ids[i] for i in keep]
            toks = [int(inputs.num_tokens[i] * 31 + i) % 1000 for i in keep]
            sc.append_output_tokens(ids, toks)
            sampled = {rid: [t] for rid, t in zip(ids, toks)}
        sched.update_from_output(out, sampled)
        steps += 1
        assert steps < 2000
    flush = sched.schedule()
    sc.update_states(flush)
    assert not sc.requests and sc.input_batch.num_reqs == 0
    assert steps >= 200
    assert sched.num_preemptions > 0
    for i, r in enumerate(trace):
        assert sched.get_request(f"r{i}").num_output_tokens == min(r.output_len, 24)
