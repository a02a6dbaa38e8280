"""Asynchronous scheduling: one step in flight, the next prepared without its tokens.

Greedy tokens equal HF's (so equal the synchronous engine's, which the parity tests pin)
under chunked prefill and forced preemption with a step in flight; seeded random sampling
and stop tokens give the same outputs with and without it; the engine waits for outputs
once per step that sampled, in ``AsyncModelRunnerOutput.result()``; a preemption with 0
and with 1 step in flight loses and repeats no token.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from attnplug.runner.commands.assemble import build_engine, resolve_backend
from attnplug.runner.commands.model_loading import build_with_backends
from attnplug.runner.commands.parity import run_parity
from attnplug.runner.step.scheduler_output import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from test_parity_hybrid import BAMBA, PROMPTS as BAMBA_PROMPTS  # noqa: E402
from test_parity_sliding import GEMMA3  # noqa: E402

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.1}


@pytest.mark.parametrize("name", ["llama", "gemma3", "bamba"])
def test_async_greedy_matches_hf_under_chunking_and_preemption(name):
    pytest.importorskip("transformers")
    cfg, kw = {"llama": (LLAMA, {}), "gemma3": (GEMMA3, {}),
               "bamba": (BAMBA, dict(max_num_batched_tokens=16, max_tokens=5, prompt_len_range=BAMBA_PROMPTS))}[name]
    res = run_parity(cfg, num_requests=5, seed=1, force_preemption=True, async_scheduling=True, **kw)
    assert res.ok, res.line()
    assert res.preemptions > 0, "forced preemption did not preempt anything"


def engine(async_scheduling: bool, *, force_preemption_every=None, budget=12, cfg=LLAMA):
    model = build_with_backends(cfg, backend=None, block_size=4, resolve=resolve_backend, seed=3)
    args = SimpleNamespace(model=None, backend=None, block_size=4, seed=0, max_model_len=64, max_num_seqs=4,
                           max_num_batched_tokens=budget, num_blocks=None, record_logits=False,
                           force_preemption_every=force_preemption_every, async_scheduling=async_scheduling)
    return build_engine(args, model=model, requests=False).engine


REQUESTS = [([5, 9, 2, 7, 1, 3, 3, 8, 4], SamplingParams(temperature=0.8, seed=11, max_tokens=9)),
            ([1, 2, 3], SamplingParams(max_tokens=7)),
            ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53], SamplingParams(temperature=1.0, top_k=5,
                                                                                    seed=5, max_tokens=6)),
            ([7] * 5, SamplingParams(temperature=0.5, top_p=0.8, seed=2, max_tokens=8))]


def run(eng, requests=REQUESTS, hook=None) -> dict[str, list[int]]:
    update = eng.scheduler.update_from_output
    eng.sampling_updates = 0

    def counted(out, sampled):  # an independent count of the steps that sampled
        eng.sampling_updates += bool(sampled)
        return update(out, sampled)

    eng.scheduler.update_from_output = counted
    for i, (prompt, sp) in enumerate(requests):
        eng.add_request(f"r{i}", prompt, sp)
    while eng.has_unfinished_requests():
        eng.step()
        if hook is not None:
            hook(eng)
    eng.run()  # flush the finished ids to the runner
    return {rid: r.output_token_ids for rid, r in sorted(eng.results.items())}


def digest(outputs: dict[str, list[int]]) -> str:
    return hashlib.sha256(repr(sorted(outputs.items())).encode()).hexdigest()


@pytest.mark.parametrize("preempt", [None, 2], ids=["plain", "forced-preemption"])
def test_seeded_sampling_is_the_same_with_and_without_a_step_in_flight(preempt):
    sync = run(engine(False, force_preemption_every=preempt))
    eng = engine(True, force_preemption_every=preempt)
    out = run(eng)
    assert digest(out) == digest(sync), (out, sync)
    assert all(len(out[f"r{i}"]) == sp.max_tokens for i, (_, sp) in enumerate(REQUESTS))
    if preempt:
        assert eng.scheduler.num_preemptions > 0
    # the engine waited for outputs once per step whose outputs carried samples
    assert 0 < eng.runner.num_output_waits == eng.sampling_updates <= eng.stats.num_steps
    # every block is back in the pools
    assert all(m.req_to_blocks == {} for m in eng.scheduler.kv_cache_manager.managers)


def test_a_stop_token_finishes_once_and_its_optimistic_step_is_dropped():
    """EOS in the middle of a batch: the request was already scheduled once more (its
    finish is learnt one step late); that sample is dropped, its blocks freed after it."""
    greedy = [(p, SamplingParams(max_tokens=8)) for p, _ in REQUESTS]
    base = run(engine(False), greedy)
    stop = base["r1"][2]  # r1 stops at its third output (earlier if the token came before)
    first = base["r1"].index(stop)
    stopped = [(p, SamplingParams(max_tokens=8, stop_token_ids=(stop,) if i == 1 else ()))
               for i, (p, _) in enumerate(greedy)]
    sync = run(engine(False), stopped)
    eng = engine(True)
    out = run(eng, stopped)
    assert out == sync
    assert out["r1"] == base["r1"][:first + 1] and out["r1"][-1] == stop
    for rid in ("r0", "r2", "r3"):
        assert out[rid] == base[rid][:len(out[rid])] and (stop in out[rid] or len(out[rid]) == 8)
    assert all(m.req_to_blocks == {} for m in eng.scheduler.kv_cache_manager.managers)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["0 in flight", "1 in flight"])
def test_preempting_a_request_loses_and_repeats_no_token(async_scheduling):
    """The seed's "discard after preemption" case (vLLM #42043): a request preempted right
    after a step that sampled it — with that step already applied (0 in flight) or still
    in flight (1) — keeps that token exactly once and recomputes the rest."""
    greedy = [(p, SamplingParams(max_tokens=8)) for p, _ in REQUESTS]
    base = run(engine(False), greedy)
    done = []

    def preempt_r1_once(eng):
        r1 = eng.scheduler.requests.get("r1")
        if not done and r1 is not None and r1.num_output_tokens >= 2 and r1.status.value == "running":
            eng.scheduler.preempt("r1")
            done.append(r1.num_output_tokens + r1.num_output_placeholders)

    eng = engine(async_scheduling)
    out = run(eng, greedy, hook=preempt_r1_once)
    assert done and eng.scheduler.requests["r1"].num_preemptions == 1
    assert out == base


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_abort_mid_batch_changes_no_other_request(async_scheduling):
    """Aborting a running request (with its step in flight, asynchronously): the others'
    outputs are unchanged, its own are a prefix of what it would have produced, and every
    block returns to the pools (after the in-flight step that used them)."""
    greedy = [(p, SamplingParams(max_tokens=8)) for p, _ in REQUESTS]
    base = run(engine(False), greedy)
    aborted = []

    def abort_r2(eng):
        r2 = eng.scheduler.requests.get("r2")
        held = [m.req_to_blocks for m in eng.scheduler.kv_cache_manager.managers]
        if aborted and len(aborted) == 1:  # the step after the abort
            assert all("r2" not in h for h in held), "blocks not freed after the step that used them"
            aborted.append("freed")
        if not aborted and r2 is not None and r2.num_output_tokens >= 1 and not r2.is_finished:
            in_flight = eng._in_flight is not None and "r2" in eng._in_flight[0].num_scheduled_tokens
            eng.abort_request("r2")
            aborted.append(r2.num_output_tokens)
            # a step that writes r2's blocks is in flight: the pool must not have them back yet
            assert all(("r2" in h) == in_flight for h in held), "freed while a step in flight uses them"
            assert in_flight == async_scheduling

    eng = engine(async_scheduling)
    out = run(eng, greedy, hook=abort_r2)
    assert len(aborted) == 2
    assert {k: v for k, v in out.items() if k != "r2"} == {k: v for k, v in base.items() if k != "r2"}
    assert out["r2"] == base["r2"][:len(out["r2"])] and len(out["r2"]) == aborted[0] < 8
    assert all(m.req_to_blocks == {} for m in eng.scheduler.kv_cache_manager.managers)
    assert "r2" not in eng.runner.compiler.requests
