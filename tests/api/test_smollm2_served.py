"""SmolLM2's real weights behind ``attnplug serve``: a chat completion through the ``openai``
client equals the greedy completion of the engine ``attnplug run`` builds (same chat
template, same tokens), streamed or not, and stops on the model's ``<|im_end|>``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

sys.path.insert(0, str(Path(__file__).parent))
from server_fixtures import offline_greedy, running_server  # noqa: E402

FLAGS = ["--max-model-len", "256", "--max-num-seqs", "2", "--max-num-batched-tokens", "128"]  # default model: smollm2


@pytest.mark.slow  # real weights: a server plus an offline engine
def test_smollm2_chat_is_offline_greedy():
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    with running_server(FLAGS) as (srv, app):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=24, temperature=0, stream=True) if c.choices)
        tok = app.state.served.tokenizer
    ids = tok.encode_chat(msgs)
    ref = offline_greedy(FLAGS, {"a": ids}, {"a": 24})["a"]
    assert ref[-1] == tok.eos_token_id  # the reply ends itself, well within 24 tokens
    assert r.choices[0].message.content == tok.decode(ref) == streamed
    assert "Paris" in streamed
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason) == (len(ids), len(ref), "stop")
