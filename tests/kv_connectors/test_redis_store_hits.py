"""Done-when of the Redis connector: run A fills the store; run B (new engine, new connector:
nothing shared but the server) gets its prefixes from it — the tokens it computes drop by
exactly the hit, its greedy outputs equal a run without the connector — on a full-attention
model and on a model with sliding-window groups."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_second_run_loads_prefixes_from_the_store_with_identical_outputs(redis_server, kv_engines, model):
    plain, base = kv_engines.run(kv_engines.build(model, None))
    out_a, a = kv_engines.run(kv_engines.build(model, redis_server.url))
    assert out_a == plain
    assert a["kv_connector"]["tokens_saved"] > 0 and redis_server.client.dbsize() > 0
    # run A may already hit: a later request shares a head with one saved in an earlier step
    assert a["scheduled_tokens"] == base["scheduled_tokens"] - a["kv_connector"]["hit_tokens"]
    out_b, b = kv_engines.run(kv_engines.build(model, redis_server.url))
    kv = b["kv_connector"]
    assert out_b == plain, "outputs after loading from the store differ from a run without the connector"
    assert kv["hit_tokens"] > a["kv_connector"]["hit_tokens"] and kv["tokens_loaded"] == kv["hit_tokens"], kv
    assert b["scheduled_tokens"] == base["scheduled_tokens"] - kv["hit_tokens"], (b["scheduled_tokens"], kv)
    assert kv["faults"] == {} and kv["loads_failed"] == 0
    assert kv["tokens_saved"] == 0, "run B saved blocks the store already held"


def test_a_hybrid_models_mamba_states_travel_with_its_attention_blocks(redis_server, kv_engines):
    """Bamba (Mamba2 + attention), prefix caching on (chunks cut at Mamba checkpoints): run B
    restores each hit's Mamba state from the store, with the attention blocks."""
    plain, base = kv_engines.run(kv_engines.build("bamba", None, prefix_caching=True))
    out_a, a = kv_engines.run(kv_engines.build("bamba", redis_server.url, prefix_caching=True))
    assert out_a == plain
    out_b, b = kv_engines.run(kv_engines.build("bamba", redis_server.url, prefix_caching=True))
    kv = b["kv_connector"]
    assert out_b == plain, "outputs after loading Mamba states from the store differ"
    assert kv["hit_tokens"] > a["kv_connector"]["hit_tokens"] and kv["faults"] == {}, kv
    assert redis_server.client.keys("attnplug:kv:*:g0:*") and redis_server.client.keys("attnplug:kv:*:g1:*")
    uncached = base["scheduled_tokens"] + base["prefix_caching"]["hit_tokens"]  # every token computed
    assert b["scheduled_tokens"] == uncached - b["prefix_caching"]["hit_tokens"] - kv["hit_tokens"], (b, kv)


def test_store_hits_extend_local_prefix_hits(redis_server, kv_engines):
    """With prefix caching on, the store provides what the local cache lacks (beyond its hit)."""
    plain, _ = kv_engines.run(kv_engines.build("llama", None))
    kv_engines.run(kv_engines.build("llama", redis_server.url))
    out, s = kv_engines.run(kv_engines.build("llama", redis_server.url, prefix_caching=True))
    assert out == plain
    assert s["kv_connector"]["hit_tokens"] > 0 and s["kv_connector"]["faults"] == {}


def test_a_loading_request_is_not_scheduled_for_compute(redis_server, kv_engines):
    from attnplug.runner.serve.request import RequestStatus
    from attnplug.runner.step.scheduler_output import SamplingParams

    kv_engines.run(kv_engines.build("llama", redis_server.url), prompts=kv_engines.PROMPTS[:1])
    setup = kv_engines.build("llama", redis_server.url)
    eng = setup.engine
    eng.add_request("r-0", kv_engines.PROMPTS[0], SamplingParams(max_tokens=2))
    out = eng.scheduler.schedule()
    req = eng.scheduler.get_request("r-0")
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and not out.num_scheduled_tokens
    assert out.kv_connector_metadata.loads and out.kv_connector_metadata.loads[0].req_id == "r-0"
    result = eng.runner.execute_model(out)
    assert result.kv_connector_output.finished_recving == {"r-0"}
    eng.scheduler.update_from_output(out, result.sampled_token_ids, result.kv_connector_output)
    nxt = eng.scheduler.schedule()
    assert nxt.scheduled_new_reqs[0].num_computed_tokens == 28  # 30 tokens: 7 blocks of 4, one left to compute
    assert nxt.num_scheduled_tokens == {"r-0": 2}


@pytest.mark.slow
def test_attnplug_run_twice_second_process_reads_the_store(redis_server):
    """Two ``attnplug run`` processes on the tiny-llama preset: the second loads its prefixes."""
    import json
    import subprocess
    import sys

    def run(*flags):
        p = subprocess.run([sys.executable, "-m", "attnplug", "run", "--model", "tiny-llama", "--num-requests", "6",
                            "--invariance-requests", "0", "--json", *flags], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    conn = ["--kv-connector", "redis", "--kv-connector-config", f"url={redis_server.url}"]
    plain, a, b = run(), run(*conn), run(*conn)
    assert plain["outputs_digest"] == a["outputs_digest"] == b["outputs_digest"]
    hit = b["kv_connector"]["hit_tokens"]
    assert hit > 0 and b["scheduled_tokens"] == plain["scheduled_tokens"] - hit


def test_a_request_aborted_while_loading_frees_its_blocks_when_the_load_ends(redis_server, kv_engines):
    from attnplug.runner.step.scheduler_output import SamplingParams

    kv_engines.run(kv_engines.build("llama", redis_server.url), prompts=kv_engines.PROMPTS[:1])
    setup = kv_engines.build("llama", redis_server.url)
    eng, sched = setup.engine, setup.engine.scheduler
    free = sched.kv_cache_manager.num_free_blocks_per_group
    eng.add_request("r-0", kv_engines.PROMPTS[0], SamplingParams(max_tokens=2))
    out = sched.schedule()
    assert "r-0" in sched.kv_loads.loading
    eng.abort_request("r-0")
    assert sched.kv_cache_manager.num_free_blocks_per_group != free, "blocks freed while the worker may write them"
    result = eng.runner.execute_model(out)
    sched.update_from_output(out, result.sampled_token_ids, result.kv_connector_output)
    assert not sched.kv_loads.loading and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks_per_group == free
    eng.runner.kv_connector.close()


def test_the_servers_metrics_show_the_connector(redis_server, kv_engines):
    from attnplug.runner.api.engine_loop import EngineLoop
    from attnplug.runner.api.metrics import ServerMetrics

    kv_engines.run(kv_engines.build("llama", redis_server.url))
    setup = kv_engines.build("llama", redis_server.url)
    _, s = kv_engines.run(setup)
    loop = EngineLoop(setup.engine, max_pending=4)
    loop._snapshot()
    text = ServerMetrics(lambda: loop.stats).render().decode()
    kv = s["kv_connector"]
    assert f"attnplug_kv_connector_hit_tokens_total {float(kv['hit_tokens'])}" in text
    assert f"attnplug_kv_connector_loaded_bytes_total {float(kv['bytes_loaded'])}" in text
    assert "attnplug_kv_connector_hit_rate" in text


def test_loaded_requests_preempted_later_recompute_to_the_same_outputs(redis_server, kv_engines):
    plain, _ = kv_engines.run(kv_engines.build("gemma3", None))
    kv_engines.run(kv_engines.build("gemma3", redis_server.url))
    out, s = kv_engines.run(kv_engines.build("gemma3", redis_server.url, preempt=2))
    assert s["preemptions"] > 0 and s["kv_connector"]["hit_tokens"] > 0
    assert out == plain


def test_loaded_requests_holding_the_whole_pool_do_not_wait_for_each_other(redis_server, kv_engines):
    """Two loads fill the pool (7 blocks each of 14); the first then needs one more block: the
    second gives its blocks back and computes from scratch later, instead of both waiting."""
    prompts = [kv_engines.PROMPTS[0], [p + 50 for p in kv_engines.PROMPTS[0]]]
    plain, _ = kv_engines.run(kv_engines.build("llama", None), prompts=prompts)
    kv_engines.run(kv_engines.build("llama", redis_server.url), prompts=prompts)
    setup = kv_engines.build("llama", redis_server.url, num_blocks=15)
    from attnplug.runner.step.scheduler_output import SamplingParams

    for i, p in enumerate(prompts):
        setup.engine.add_request(f"r-{i}", p, SamplingParams(max_tokens=6))
    results = setup.engine.run(max_steps=100)
    assert not setup.engine.has_unfinished_requests(), "loaded requests wait for each other's blocks"
    assert {rid: r.output_token_ids for rid, r in sorted(results.items())} == plain
    assert setup.engine.scheduler.kv_loads.num_dropped == 1
