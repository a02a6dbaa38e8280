"""The real ``openai`` client against ``attnplug serve`` (random-weight preset): completion,
chat, streaming, usage, models, health and ``/metrics`` read by prometheus_client's parser."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from server_fixtures import PRESET_FLAGS, offline_greedy, pools_full, running_server  # noqa: E402


@pytest.fixture(scope="module")
def server():
    with running_server(PRESET_FLAGS) as (srv, app):
        yield srv, app, openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _wait_idle(app, timeout=10.0):
    deadline = time.monotonic() + timeout
    while app.state.engine_loop.num_pending and time.monotonic() < deadline:
        time.sleep(0.01)


def test_completion_is_offline_greedy_with_exact_usage(server):
    srv, app, client = server
    tok = app.state.served.tokenizer
    prompt = "The quick brown fox"
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0)
    ids = tok.encode(prompt)
    ref = offline_greedy(PRESET_FLAGS, {"a": ids}, {"a": 12})["a"]
    assert r.choices[0].text == tok.decode(ref)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)
    assert r.usage.total_tokens == len(ids) + len(ref)
    assert r.choices[0].finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
    # a stop token ends it and is counted (usage counts every sampled token, the stop one too)
    j = 3
    stop_id = ref[j]
    r3 = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0,
                                   extra_body={"stop_token_ids": [stop_id]})
    k = ref.index(stop_id)
    assert (r3.usage.completion_tokens, r3.choices[0].finish_reason) == (k + 1, "stop")
    assert r3.choices[0].text == tok.decode(ref[: k + 1])
    # token-id prompts are the same request
    r2 = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == r.choices[0].text


def test_chat_uses_the_chat_template(server):
    srv, app, client = server
    tok = app.state.served.tokenizer
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=10, temperature=0)
    ids = tok.encode("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n"
                     "<|im_start|>assistant\n")
    assert tok.encode_chat(msgs) == ids
    ref = offline_greedy(PRESET_FLAGS, {"a": ids}, {"a": 10})["a"]
    assert r.choices[0].message.content == tok.decode(ref)
    assert r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref))


def test_streaming_is_incremental_and_adds_up(server):
    srv, app, client = server
    kw = dict(model="tiny-llama", messages=[{"role": "user", "content": "count"}], max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            finish = c.finish_reason or finish
    assert len(pieces) >= 3  # token by token, not one blob at the end
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-llama", prompt="abc", max_tokens=16, temperature=0, stream=True) if c.choices)
    assert text == client.completions.create(model="tiny-llama", prompt="abc", max_tokens=16,
                                             temperature=0).choices[0].text


def test_stop_string_and_seeded_sampling(server):
    srv, app, client = server
    base = client.completions.create(model="tiny-llama", prompt="xyz", max_tokens=24, temperature=0).choices[0].text
    assert len(base) > 4
    stop = base[3:5]
    r = client.completions.create(model="tiny-llama", prompt="xyz", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == base[: base.index(stop)] and r.choices[0].finish_reason == "stop"
    s = [client.completions.create(model="tiny-llama", prompt="xyz", max_tokens=12, temperature=1.5, top_p=0.9,
                                   extra_body={"top_k": 50}, seed=7).choices[0].text for _ in range(2)]
    assert s[0] == s[1] != client.completions.create(model="tiny-llama", prompt="xyz", max_tokens=12,
                                                     temperature=1.5, seed=8).choices[0].text
    _wait_idle(app)
    assert pools_full(app)


def test_models_health_and_metrics(server):
    from prometheus_client.parser import text_string_to_metric_families

    srv, app, client = server
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert httpx.get(srv.url + "/health").status_code == 200
    client.completions.create(model="tiny-llama", prompt="metrics", max_tokens=5, temperature=0)
    _wait_idle(app)
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert value[("attnplug_num_requests_running", ())] == 0
    assert value[("attnplug_kv_cache_blocks_in_use", (("group", "0"), ("kind", "full_attention")))] == 0
    assert value[("attnplug_kv_cache_blocks_total", (("group", "0"), ("kind", "full_attention")))] > 0
    n = value[("attnplug_request_success_total", (("finished_reason", "finished"),))]
    assert n >= 1
    assert value[("attnplug_time_to_first_token_seconds_count", ())] == n
    assert value[("attnplug_e2e_request_latency_seconds_count", ())] == n
    assert value[("attnplug_inter_token_latency_seconds_count", ())] >= 4  # 5 tokens: 4 gaps at least once
    assert value[("attnplug_generation_tokens_total", ())] >= 5
    assert ("attnplug_prefix_cache_hit_rate", ()) in value and ("attnplug_spec_decode_acceptance_rate", ()) in value
