"""A step that raises, with ``LLMEngine.survive_step_errors``: the requests of the steps in
flight finish (``StepFailed`` names them), their blocks go back to the pools, the others
and later requests run on to the same greedy tokens as an engine that never failed;
without it the exception propagates unchanged (``attnplug run``)."""

from __future__ import annotations

import argparse

import pytest

from attnplug.runner.commands.assemble import build_engine
from attnplug.runner.serve.step_failure import StepFailed
from attnplug.runner.step.scheduler_output import SamplingParams


def _engine(async_scheduling: bool):
    args = argparse.Namespace(model="tiny-llama", backend=None, block_size=16, seed=0, max_model_len=128,
                              max_num_seqs=2, max_num_batched_tokens=64, num_blocks=None,
                              async_scheduling=async_scheduling)
    return build_engine(args, requests=False).engine


PROMPTS = {f"r{i}": [(7 * i + j) % 2000 + 1 for j in range(5 + 3 * i)] for i in range(4)}
SP = SamplingParams(temperature=0.0, max_tokens=6)


def _reference():
    eng = _engine(False)
    for rid, p in PROMPTS.items():
        eng.add_request(rid, p, SP)
    return {rid: r.output_token_ids for rid, r in eng.run().items()}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_failed_step_finishes_its_requests_and_the_engine_goes_on(async_scheduling):
    eng = _engine(async_scheduling)
    eng.survive_step_errors = True
    pools = eng.scheduler.kv_cache_manager.pools
    for rid in ("r0", "r1", "r2"):  # max_num_seqs=2: r2 waits
        eng.add_request(rid, PROMPTS[rid], SP)
    eng.step()
    eng.step()
    name = "execute_model_async" if async_scheduling else "execute_model"
    real = getattr(eng.runner, name)

    def boom(out):
        raise RuntimeError("planted")

    if async_scheduling:  # aborted while its step is in flight: its blocks wait for that step
        eng.abort_request("r1")
        assert eng.scheduler.get_request("r1").free_when_idle
    setattr(eng.runner, name, boom)
    with pytest.raises(StepFailed) as e:
        eng.step()
    setattr(eng.runner, name, real)
    # asynchronously, r1's abort let r2 into the failing step
    failed = ["r0", "r1", "r2"] if async_scheduling else ["r0", "r1"]
    assert sorted(e.value.req_ids) == failed and "planted" in str(e.value)
    assert set(failed) <= set(eng.results)
    assert sum(p.num_used_blocks for p in pools) == 0  # nothing else holds blocks
    eng.add_request("r3", PROMPTS["r3"], SP)
    results = eng.run()
    ref = _reference()
    for rid in sorted({"r2", "r3"} - set(failed)):
        assert results[rid].output_token_ids == ref[rid]
    assert all(p.num_free_blocks == p.capacity for p in pools)


def test_without_survive_the_exception_propagates():
    eng = _engine(False)
    eng.add_request("r0", PROMPTS["r0"], SP)

    def boom(out):
        raise RuntimeError("planted")

    eng.runner.execute_model = boom
    with pytest.raises(RuntimeError, match="planted"):
        eng.step()
