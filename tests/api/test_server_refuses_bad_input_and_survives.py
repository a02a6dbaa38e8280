"""Bad input never takes the server down: each bad body is a 400 OpenAI error naming the
field, a full server answers 503, a step that raises fails its requests with 500 and the
server goes on, and a client that leaves mid-stream gives its blocks back."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from server_fixtures import PRESET_FLAGS, pools_full, running_server  # noqa: E402

OK = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server():
    with running_server(PRESET_FLAGS) as (srv, app):
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            yield srv, app, http


def _wait_idle(app, timeout=10.0):
    deadline = time.monotonic() + timeout
    while app.state.engine_loop.num_pending and time.monotonic() < deadline:
        time.sleep(0.01)


BAD = [
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", {**OK, "model": "gpt-4"}, "model"),
    ("completions", {**OK, "max_tokens": 0}, "max_tokens"),
    ("completions", {**OK, "max_tokens": -3}, "max_tokens"),
    ("completions", {**OK, "max_tokens": 10_000}, "max_tokens"),
    ("completions", {**OK, "max_tokens": 127}, "max_tokens"),  # 2 prompt tokens + 127 > max_model_len 128
    ("completions", {**OK, "prompt": "x" * 200}, "prompt"),
    ("completions", {**OK, "prompt": []}, "prompt"),
    ("completions", {**OK, "prompt": [1, 99999]}, "prompt"),
    ("completions", {**OK, "temperature": -0.5}, "temperature"),
    ("completions", {**OK, "temperature": "hot"}, "temperature"),
    ("completions", {**OK, "max_tokens": "4"}, "max_tokens"),
    ("completions", {**OK, "max_tokens": 4.5}, "max_tokens"),
    ("completions", {**OK, "top_p": 0}, "top_p"),
    ("completions", {**OK, "seed": -1}, "seed"),
    ("completions", {**OK, "n": 2}, "n"),
    ("completions", {**OK, "stop": ["a", ""]}, "stop"),
    ("completions", {**OK, "stream": "yes"}, "stream"),
    ("completions", {k: v for k, v in OK.items() if k != "prompt"}, "prompt"),
    ("chat/completions", {**CHAT, "messages": []}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "y" * 150}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_body_is_a_400_naming_the_field(server, path, body, param):
    srv, app, http = server
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(f"/v1/{path}", content=data, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    if param is None and isinstance(body, bytes) and body.startswith(b"{"):
        assert "malformed JSON" in err["message"]


def test_the_server_still_serves_after_bad_input(server):
    srv, app, http = server
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=OK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    _wait_idle(app)
    assert pools_full(app)


def test_a_full_server_answers_503(server):
    srv, app, http = server
    loop = app.state.engine_loop
    saved, loop.max_pending = loop.max_pending, 0
    try:
        r = http.post("/v1/completions", json=OK)
    finally:
        loop.max_pending = saved
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "server_overloaded"
    assert http.post("/v1/completions", json=OK).status_code == 200


def test_a_step_that_raises_fails_its_requests_with_500(server):
    srv, app, http = server
    runner = app.state.engine_loop.engine.runner
    real = runner.execute_model
    calls = {"n": 0}

    def flaky(out):
        if out.total_num_scheduled_tokens and calls["n"] == 0:
            calls["n"] += 1
            raise RuntimeError("planted kernel failure")
        return real(out)

    runner.execute_model = flaky
    try:
        r = http.post("/v1/completions", json=OK)
    finally:
        runner.execute_model = real
    assert r.status_code == 500 and "planted kernel failure" in r.json()["error"]["message"]
    _wait_idle(app)
    assert pools_full(app)
    again = http.post("/v1/completions", json=OK)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] is not None


def test_a_client_leaving_mid_stream_aborts_and_frees_its_blocks(server):
    srv, app, http = server
    loop = app.state.engine_loop
    kv = loop.engine.scheduler.kv_cache_manager
    body = {**OK, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few events in: the request holds blocks now
        assert any(line.startswith("data: {") for line in got)
        assert kv.pools[0].num_used_blocks > 0
    deadline = time.monotonic() + 10
    while (loop.num_pending or not pools_full(app)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pools_full(app) and loop.num_pending == 0
    fams = http.get("/metrics").text
    assert 'attnplug_request_success_total{finished_reason="aborted"}' in fams


def test_a_client_leaving_a_non_streamed_request_aborts_it(server):
    srv, app, http = server
    loop = app.state.engine_loop
    body = {**OK, "max_tokens": 120, "ignore_eos": True}
    before = loop.engine.stats.num_generated_tokens
    runner = loop.engine.runner
    real = runner.execute_model

    def slow(out):  # 120 steps take 2.4 s at least: the client leaves long before
        time.sleep(0.02)
        return real(out)

    runner.execute_model = slow
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=0.3)
        deadline = time.monotonic() + 10
        while (loop.num_pending or not pools_full(app)) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        runner.execute_model = real
    assert pools_full(app) and loop.num_pending == 0
    assert loop.engine.stats.num_generated_tokens - before < 120  # stopped before its max_tokens
