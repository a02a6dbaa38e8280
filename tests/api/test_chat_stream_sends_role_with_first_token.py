"""A streamed chat's first chunk with ``choices`` is sent with the first text, not on receipt.

``vllm bench serve --backend openai-chat`` (and AIPerf) time TTFT at the first SSE chunk that
has ``choices`` and count every later one as an inter-token gap: a role chunk sent before the
engine produced anything made their TTFT the HTTP round trip (10 ms measured against a 700 ms
prefill) and added a prefill-long "ITL"."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
from attnplug.runner.api.app import Outcome, _chat_stream  # noqa: E402


def _events(sse: list[str]) -> list[dict]:
    out = []
    for s in sse:
        data = s.strip().removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_role_rides_on_the_first_text_chunk():
    produced = []

    async def gen():
        await asyncio.sleep(0)
        produced.append("Hel")
        yield "Hel", None
        produced.append("lo")
        yield "lo", Outcome("length", 2)

    async def drain():
        sse, seen_at_first = [], None
        async for s in _chat_stream(gen(), "r", 0, "m", 3, include_usage=True):
            if seen_at_first is None:
                seen_at_first = list(produced)
            sse.append(s)
        return sse, seen_at_first

    sse, seen_at_first = asyncio.run(drain())
    assert seen_at_first == ["Hel"]  # nothing went out before the engine's first text
    ev = _events(sse)
    with_choices = [e for e in ev if e != "[DONE]" and e["choices"]]
    assert [c["choices"][0]["delta"] for c in with_choices] == [{"role": "assistant", "content": "Hel"},
                                                                 {"content": "lo"}]
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"
    assert ev[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert ev[-1] == "[DONE]"
