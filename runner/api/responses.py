"""Response bodies and stream chunks in OpenAI's shapes (``openai`` client's ``Completion``,
``ChatCompletion``, ``ChatCompletionChunk``; streamed as server-sent events, ``data: JSON``
then ``data: [DONE]``)."""

from __future__ import annotations

import json
from typing import Any


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                    use: dict[str, int] | None) -> dict[str, Any]:
    """A ``text_completion`` (also each streamed chunk, with ``use`` only where asked)."""
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if use is not None:
        body["usage"] = use
    return body


def chat_body(rid: str, created: int, model: str, text: str, finish_reason: str,
              use: dict[str, int]) -> dict[str, Any]:
    """A ``chat.completion``."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": use}


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any] | None,
               finish_reason: str | None = None, use: dict[str, int] | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk``: one choice with ``delta``, or (``delta`` ``None``) the
    usage chunk, whose ``choices`` is empty."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def usage_completion_chunk(rid: str, created: int, model: str, use: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a streamed completion with ``include_usage``: no choices."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
            "usage": use}


def sse(body: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"
