"""The engine flags of ``run`` work behind the server: asynchronous scheduling, prefix
caching and speculative decoding give offline greedy's text, and ``/metrics`` shows the
prefix-cache hits and the speculative drafts."""

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


def _metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
            for s in f.samples if not s.labels}


@pytest.mark.parametrize("extra", [pytest.param(["--async-scheduling"], marks=pytest.mark.slow),
                                   ["--prefix-caching", "--speculative", "ngram:k=3"]], ids=["async", "prefix+spec"])
def test_engine_flags_behind_the_server(extra):
    flags = PRESET_FLAGS + ["--max-model-len", "256"] + extra
    shared = "a shared system prompt that is long enough to fill whole blocks: " * 2
    prompts = [shared + f"question {i}" for i in range(4)]
    with running_server(flags) as (srv, app):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        tok = app.state.served.tokenizer
        texts = [client.completions.create(model="tiny-llama", prompt=p, max_tokens=16, temperature=0).choices[0].text
                 for p in prompts]
        deadline = time.monotonic() + 10
        while app.state.engine_loop.num_pending and time.monotonic() < deadline:
            time.sleep(0.01)
        m = _metrics(srv.url)
        assert pools_full(app)  # cached blocks of finished requests count as free (evictable)
    ids = {f"r{i}": tok.encode(p) for i, p in enumerate(prompts)}
    ref = offline_greedy(flags, ids, {r: 16 for r in ids})
    assert texts == [tok.decode(ref[f"r{i}"]) for i in range(4)]
    if "--prefix-caching" in extra:
        assert m["attnplug_prefix_cache_hits_total"] > 0 and 0 < m["attnplug_prefix_cache_hit_rate"] <= 1
        assert m["attnplug_spec_decode_draft_tokens_total"] > 0
        assert m["attnplug_spec_decode_acceptance_rate"] == pytest.approx(
            m["attnplug_spec_decode_accepted_tokens_total"] / m["attnplug_spec_decode_draft_tokens_total"])
