"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``, and OpenAI's error object.

Fields and meanings follow the OpenAI API reference (``openai`` Python client's
``CompletionCreateParams`` / ``CompletionCreateParamsBase`` of chat); extensions from vLLM's
server that benchmark clients send: ``top_k`` (``-1`` or ``0``: off), ``ignore_eos``,
``stop_token_ids``. Bodies are read with pydantic in strict mode (``"5"`` is not an int,
``true`` is not a number); unknown fields are ignored, as OpenAI-compatible servers do.
Everything the engine cannot do is refused with HTTP 400 rather than silently ignored:
``n`` other than 1, ``logprobs``, ``echo``, ``best_of`` other than 1.

An error is ``{"error": {"message", "type", "param", "code"}}`` (``param``: the field at
fault, dotted for nested fields, e.g. ``messages.0.content``; ``null`` when none is).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_MAX = 2**63 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False
    """Streaming: one more chunk before ``[DONE]``, with ``usage`` and no choices."""


class SamplingFields(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    model: str
    max_tokens: int | None = None
    """Output tokens at most (``>= 1``); default: what ``max_model_len`` leaves after the prompt."""
    temperature: float | None = Field(None, ge=0)
    """``0``: greedy; default 1 (OpenAI's)."""
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = None
    """Up to 4 non-empty strings; the text ends before the first that appears."""
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    """Do not stop on the model's end-of-sequence token (benchmarks: fixed output lengths)."""
    n: int = 1
    best_of: int | None = None
    logprobs: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    """Text, or the prompt's token ids."""
    echo: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    """Chat's newer name for ``max_tokens`` (wins when both are given)."""


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with an OpenAI error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def unsupported(req: SamplingFields) -> RequestError | None:
    """A field the engine cannot honour (module docstring), or ``None``."""
    if req.n != 1:
        return RequestError(f"n={req.n} is not supported: one choice per request (n=1)", "n")
    if req.best_of not in (None, 1):
        return RequestError("best_of is not supported", "best_of")
    if req.logprobs not in (None, False):
        return RequestError("logprobs are not supported", "logprobs")
    if getattr(req, "echo", False):
        return RequestError("echo is not supported", "echo")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        return RequestError("stop must be up to 4 non-empty strings", "stop")
    if any(t < 0 for t in req.stop_token_ids or ()):
        return RequestError("stop_token_ids must be token ids (>= 0)", "stop_token_ids")
    if req.stream_options is not None and not req.stream:
        return RequestError("stream_options is only allowed with stream: true", "stream_options")
    return None


def validation_error(errors: list[dict[str, Any]]) -> RequestError:
    """A :class:`RequestError` from pydantic's / FastAPI's error list: the first error's field."""
    if not errors:
        return RequestError("invalid request body")
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return RequestError(f"malformed JSON body: {e.get('msg', '')} (at character {loc[0] if loc else '?'})")
    if e.get("type") == "model_attributes_type" or not loc:
        return RequestError(f"the body must be a JSON object: {e.get('msg', '')}")
    # a union's member names ("str", "list[int]", "function-after[...]") are not fields
    fields = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool")]
    param = ".".join(fields)
    return RequestError(f"{param}: {e.get('msg', 'invalid value')}", param or None)
