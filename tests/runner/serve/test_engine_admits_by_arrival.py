"""The engine admits requests at their arrival times on an injected clock: none is scheduled
before it arrives, an idle engine sleeps until the next arrival, token times are the times
the engine read each step's outputs, and the latencies of a synthetic run (each step takes
0.1 s) equal hand-computed values; warm-up requests leave no trace in the figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from attnplug.core.errors import InvalidRequestError
from attnplug.runner.commands.assemble import build_engine, resolve_backend
from attnplug.runner.commands.model_loading import build_with_backends
from attnplug.runner.commands.serving_metrics import serving_metrics
from attnplug.runner.serve.clock import ManualClock
from attnplug.runner.step.scheduler_output import SamplingParams

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.1}
STEP_S = 0.1


@pytest.fixture(scope="module")
def model():
    return build_with_backends(LLAMA, backend=None, block_size=4, resolve=resolve_backend, seed=3)


def engine(model, async_scheduling=False):
    """An engine on a ManualClock whose every ``execute_model`` takes STEP_S seconds."""
    args = SimpleNamespace(model=None, backend=None, block_size=4, seed=0, max_model_len=64, max_num_seqs=4,
                           max_num_batched_tokens=64, num_blocks=None, record_logits=False,
                           force_preemption_every=None, async_scheduling=async_scheduling)
    eng = build_engine(args, model=model, requests=False).engine
    eng.clock = clock = ManualClock()
    runner = eng.runner
    for name in ("execute_model", "execute_model_async"):
        real = getattr(runner, name)

        def timed(out, _real=real):
            clock.advance(STEP_S)
            return _real(out)
        setattr(runner, name, timed)
    return eng


REQUESTS = [("a", [5, 9, 2, 7, 1], 3, 0.0), ("b", [1, 2, 3], 2, 0.25), ("c", [4, 4, 8, 1], 2, 1.0)]


def test_synthetic_run_latencies_equal_hand_computed(model):
    eng = engine(model)
    for rid, prompt, n, t in REQUESTS:
        eng.add_request(rid, prompt, SamplingParams(max_tokens=n), arrival_time=t)
    assert len(eng.pending) == 2 and eng.scheduler.get_num_unfinished_requests() == 1  # b, c not arrived
    eng.run()
    # step 1 (0 -> 0.1): a's prefill, token 1 | steps 2, 3: a's tokens 2, 3 at 0.2, 0.3 (b arrives at 0.25,
    # admitted at the start of step 4) | step 4: b's prefill, token at 0.4 | step 5: 0.5 | idle: sleep 0.5
    # until c arrives at 1.0 | step 6: c's token at 1.1 | step 7: 1.2
    t = {rid: eng.results[rid].timing for rid, *_ in REQUESTS}
    assert t["a"].chunk_times == pytest.approx([0.1, 0.2, 0.3])
    assert t["b"].chunk_times == pytest.approx([0.4, 0.5])
    assert t["c"].chunk_times == pytest.approx([1.1, 1.2])
    assert eng.clock.slept == pytest.approx([0.5])
    assert [t[r].first_scheduled_time for r in "abc"] == pytest.approx([0.0, 0.3, 1.0])
    m = serving_metrics([t[r] for r in "abc"], [5, 3, 4], [3, 2, 2], 1.2)
    # TTFT a 0.1, b 0.4 - 0.25 = 0.15, c 0.1 | E2EL a 0.3, b 0.25, c 0.2 | TPOT 0.1 each | ITL all 0.1
    assert m["mean_ttft_ms"] == pytest.approx((100 + 150 + 100) / 3)
    assert m["median_e2el_ms"] == pytest.approx(250) and m["mean_e2el_ms"] == pytest.approx(250)
    assert m["mean_tpot_ms"] == pytest.approx(100) and m["std_itl_ms"] == pytest.approx(0, abs=1e-9)
    assert m["request_throughput"] == pytest.approx(3 / 1.2)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_request_is_scheduled_before_it_arrives(model, async_scheduling):
    eng = engine(model, async_scheduling)
    arrivals = [0.0, 0.05, 0.05, 0.33, 0.9, 0.9, 2.5, 2.55]
    for i, t in enumerate(arrivals):
        eng.add_request(f"r{i}", [3 + i, 1, 4, 1, 5][: 2 + i % 4], SamplingParams(max_tokens=1 + i % 3),
                        arrival_time=t)
    seen = []
    schedule = eng.scheduler.schedule

    def spy():
        out = schedule()
        seen.extend((r.req_id, eng.clock.now()) for r in out.scheduled_new_reqs)
        return out
    eng.scheduler.schedule = spy
    res = eng.run()
    assert sorted(res) == sorted(f"r{i}" for i in range(len(arrivals)))
    for rid, when in seen:
        assert when >= arrivals[int(rid[1:])] - 1e-12, f"{rid} scheduled at {when} before it arrived"
    for rid in res:
        tm = res[rid].timing
        assert tm.first_scheduled_time >= tm.arrival_time and tm.chunk_times[0] > tm.arrival_time
        assert tm.num_output_tokens == len(res[rid].output_token_ids)


def test_pending_requests_are_validated_and_can_be_aborted(model):
    eng = engine(model)
    eng.add_request("x", [1, 2], SamplingParams(max_tokens=2), arrival_time=5.0)
    with pytest.raises(InvalidRequestError, match="duplicate"):
        eng.add_request("x", [1, 2], SamplingParams(max_tokens=2), arrival_time=6.0)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        eng.add_request("y", [], SamplingParams(max_tokens=2), arrival_time=6.0)
    with pytest.raises(InvalidRequestError, match="finite"):
        eng.add_request("z", [1], SamplingParams(max_tokens=2), arrival_time=float("nan"))
    assert len(eng.pending) == 1 and "y" not in eng.timings and "z" not in eng.timings
    eng.abort_request("x")
    assert not eng.has_unfinished_requests() and eng.results["x"].output_token_ids == []


def test_warm_up_leaves_no_trace_in_the_figures(model):
    from attnplug.runner.commands.replay import warm_up

    def counters(eng):
        return (eng.stats.num_steps, eng.stats.num_generated_tokens, eng.stats.num_scheduled_tokens,
                eng.scheduler.num_preemptions, eng.scheduler.peak_blocks_per_group,
                {s: len(v) for s, v in eng.runner.timings_ns.items()})

    figures = []
    for warm in ([], [("warmup-0", [7, 7, 7, 7, 7, 7], SamplingParams(max_tokens=5))]):
        eng = engine(model)
        warm_up(eng, warm)
        for rid, prompt, n, _ in REQUESTS:
            eng.add_request(rid, prompt, SamplingParams(max_tokens=n))
        res = eng.run()
        assert sorted(res) == ["a", "b", "c"]
        figures.append(counters(eng))
    assert figures[0] == figures[1]
