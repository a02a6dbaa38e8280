"""Many concurrent clients, some leaving mid-stream, malformed bodies mixed in: every
well-formed request gets the text of offline greedy decoding (the engine ``attnplug run``
builds, same flags), the pools end full and ``/health`` still answers. The default suite
runs a small load; ``-m slow`` the issue's 200 requests from 32 clients."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from server_fixtures import PRESET_FLAGS, offline_greedy, pools_full, running_server  # noqa: E402

MALFORMED = [b"{", b'{"model": "tiny-llama", "prompt": 5}', b'{"model": "tiny-llama", "prompt": "a", "max_tokens": 0}',
             b'{"model": "nope", "prompt": "a"}', b'{"model": "tiny-llama", "prompt": "a", "temperature": -1}']


async def _well_formed(client, i, prompt, max_tokens, stream):
    kw = dict(model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0)
    if not stream:
        r = await client.completions.create(**kw)
        return r.choices[0].text, r.usage.completion_tokens
    text, usage = [], None
    async for chunk in await client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        text.extend(c.text for c in chunk.choices)
    return "".join(text), usage


async def _disconnecting(http):
    body = {"model": "tiny-llama", "prompt": "leave early", "max_tokens": 60, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: {")
            if n >= 2:
                return "left"
    return "finished"


async def _load(url, jobs, concurrency):
    sem = asyncio.Semaphore(concurrency)
    results = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def one(i, kind, arg):
            async with sem:
                if kind == "bad":
                    r = await http.post("/v1/completions", content=arg, headers={"content-type": "application/json"})
                    results[i] = (r.status_code, r.json()["error"]["type"])
                elif kind == "leave":
                    results[i] = await _disconnecting(http)
                else:
                    results[i] = await _well_formed(client, i, *arg)

        await asyncio.gather(*(one(i, k, a) for i, (k, a) in enumerate(jobs)))
        await client.close()
    return results


def _run_load(num_requests, concurrency):
    rng = random.Random(0)
    jobs = []
    for i in range(num_requests):
        u = rng.random()
        if u < 0.10:
            jobs.append(("leave", None))
        elif u < 0.18:
            jobs.append(("bad", rng.choice(MALFORMED)))
        else:
            prompt = f"request {i}: " + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 40)))
            jobs.append(("ok", (prompt, rng.randint(2, 20), rng.random() < 0.5)))
    with running_server(PRESET_FLAGS) as (srv, app):
        tok = app.state.served.tokenizer
        results = asyncio.run(_load(srv.url, jobs, concurrency))
        loop = app.state.engine_loop
        deadline = time.monotonic() + 30
        while (loop.num_pending or not pools_full(app) or loop.engine.scheduler.requests) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pools_full(app) and loop.num_pending == 0
        assert loop.engine.scheduler.requests == {} and loop.engine.results == {}  # nothing kept per request
        assert httpx.get(srv.url + "/health").status_code == 200
    ok = {f"r{i}": a for i, (k, a) in enumerate(jobs) if k == "ok"}
    ref = offline_greedy(PRESET_FLAGS, {r: tok.encode(a[0]) for r, a in ok.items()}, {r: a[1] for r, a in ok.items()})
    for i, (kind, arg) in enumerate(jobs):
        if kind == "ok":
            want = ref[f"r{i}"]
            assert results[i] == (tok.decode(want), len(want)), f"request {i}"
        elif kind == "bad":
            assert results[i] == (400, "invalid_request_error")
        else:
            assert results[i] == "left"
    assert sum(k == "leave" for k, _ in jobs) >= 1 and sum(k == "bad" for k, _ in jobs) >= 1


def test_small_load_with_disconnects_and_malformed_bodies():
    _run_load(num_requests=16, concurrency=8)


@pytest.mark.slow
def test_200_requests_from_32_clients():
    _run_load(num_requests=200, concurrency=32)
