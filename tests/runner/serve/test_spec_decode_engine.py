"""Speculative decoding end to end: scheduler → step compiler → model → rejection sampler →
rollback, on real (tiny, random-init) Llama and Gemma3 models.

Greedy output with ``--speculative ngram:k=3`` is token-identical to HF transformers (and
so to the engine without speculation, which the parity tests pin) under chunked prefill
and forced preemption, with drafts really accepted (the acceptance counter is asserted
> 0, so the multi-token verification path runs). Seeded random sampling with
speculation reproduces itself and emits only tokens of the request's own stream rules;
the scheduler rolls ``num_computed_tokens`` back by the rejected count; asynchronous
scheduling is refused at configuration time (Mamba models are served:
``test_spec_decode_state_groups.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from attnplug.core.errors import ConfigError, MetadataError
from attnplug.runner.commands.assemble import build_engine, resolve_backend
from attnplug.runner.commands.model_loading import build_with_backends
from attnplug.runner.commands.parity import run_parity
from attnplug.runner.step.compiler import snapshot_diff
from attnplug.runner.step.scheduler_output import SamplingParams
from attnplug.runner.step.packed_deltas import draft_tokens

sys.path.insert(0, str(Path(__file__).parent))
from test_async_scheduling import LLAMA  # noqa: E402
from test_parity_hybrid import BAMBA  # noqa: E402
from test_parity_sliding import GEMMA3  # noqa: E402


@pytest.mark.parametrize("name, preempt", [("llama", False), ("llama", True), ("gemma3", True)])
def test_greedy_spec_decode_matches_hf_under_chunking_and_preemption(name, preempt):
    pytest.importorskip("transformers")
    cfg = {"llama": LLAMA, "gemma3": GEMMA3}[name]
    res = run_parity(cfg, num_requests=4, seed=1, force_preemption=preempt, max_tokens=12,
                     max_num_batched_tokens=16, prompt_len_range=(3, 20), speculative="ngram:k=3")
    assert res.ok, res.line()
    assert res.spec["accepted"] > 0, f"no draft was accepted: the verification path did not run ({res.spec})"
    if preempt:
        assert res.preemptions > 0


def engine(spec, *, cfg=LLAMA, budget=12, preempt=None, async_scheduling=False):
    model = build_with_backends(cfg, backend=None, block_size=4, resolve=resolve_backend, seed=3)
    args = SimpleNamespace(model=None, backend=None, block_size=4, seed=0, max_model_len=64, max_num_seqs=4,
                           max_num_batched_tokens=budget, num_blocks=None, record_logits=False,
                           force_preemption_every=preempt, async_scheduling=async_scheduling, speculative=spec)
    return build_engine(args, model=model, requests=False).engine


# Prompts with repetition: the n-gram drafter finds matches from the first decode on.
REQUESTS = [([5, 9, 2, 7, 5, 9, 2, 7, 5, 9], SamplingParams(max_tokens=16)),
            ([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.8, seed=7, max_tokens=12)),
            (list(range(20, 34)), SamplingParams(max_tokens=10)),
            ([7] * 5, SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=14))]


def run(eng, requests=REQUESTS) -> dict[str, list[int]]:
    for i, (prompt, sp) in enumerate(requests):
        eng.add_request(f"r{i}", prompt, sp)
    eng.run()
    return {rid: r.output_token_ids for rid, r in sorted(eng.results.items())}


def test_greedy_rows_equal_no_speculation_and_seeded_rows_reproduce():
    base = run(engine(None, preempt=3))
    eng = engine("ngram:k=3", preempt=3)
    out = run(eng)
    stats = eng.scheduler.spec.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    for rid in ("r0", "r2"):  # greedy: exactly the tokens of one-token steps
        assert out[rid] == base[rid]
    assert all(len(out[f"r{i}"]) == sp.max_tokens for i, (_, sp) in enumerate(REQUESTS))
    assert run(engine("ngram:k=3", preempt=3)) == out  # seeded sampling with drafts reproduces
    assert all(m.req_to_blocks == {} for m in eng.scheduler.kv_cache_manager.managers)


def test_fewer_steps_than_without_speculation_on_repetitive_greedy_prompts():
    greedy = [(p, SamplingParams(max_tokens=10)) for p, _ in REQUESTS]
    plain, spec = engine(None), engine("ngram:k=3")
    assert run(plain, greedy) == run(spec, greedy)
    assert spec.stats.num_steps < plain.stats.num_steps, (spec.stats, plain.stats)


def test_rollback_advances_num_computed_by_the_accepted_tokens_only():
    eng = engine("ngram:k=3", budget=32)
    sched = eng.scheduler
    eng.add_request("a", [4, 8, 4, 8, 4, 8, 4, 8], SamplingParams(max_tokens=20))
    seen = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        drafts = draft_tokens(out).get("a", [])
        req = sched.get_request("a")
        before = req.num_computed_tokens
        assert out.num_scheduled_tokens.get("a", 0) == (1 + len(drafts) if drafts else out.num_scheduled_tokens["a"])
        result = eng.runner.execute_model(out)
        sched.update_from_output(out, result.sampled_token_ids)
        if drafts and not req.is_finished:
            emitted = len(result.sampled_token_ids["a"])
            assert 1 <= emitted <= 1 + len(drafts)
            assert req.num_computed_tokens == before + emitted  # 1 + d scheduled, d - (emitted - 1) rejected
            assert req.num_tokens_to_compute == 1  # the next step computes only the last emitted token
            seen += 1
    assert seen > 0


def test_async_scheduling_is_refused_at_configuration_time_and_mamba_models_are_not():
    engine("ngram:k=2", cfg=BAMBA)  # state groups: tests/runner/execute/test_spec_decode_state_groups.py
    with pytest.raises(ConfigError, match="synchronous"):
        engine("ngram:k=2", async_scheduling=True)


def test_the_asynchronous_runner_refuses_a_step_with_drafts():
    eng = engine("ngram:k=3")
    eng.add_request("a", [4, 8] * 4, SamplingParams(max_tokens=8))
    sched = eng.scheduler
    out = sched.schedule()
    while not draft_tokens(out):
        sched.update_from_output(out, eng.runner.execute_model(out).sampled_token_ids)
        out = sched.schedule()
    before = eng.runner.compiler.snapshot()
    with pytest.raises(MetadataError, match="draft tokens"):
        eng.runner.execute_model_async(out)
    assert not snapshot_diff(before, eng.runner.compiler.snapshot())
