"""The FastAPI application: OpenAI's endpoints over one :class:`EngineLoop`.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` answers with
server-sent events; ``stream_options.include_usage`` adds a usage chunk before
``[DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (``metrics.py``).

Errors are OpenAI error objects (``protocol.py``): 400 for a body the server refuses
(naming the field), 503 when ``max_pending`` requests are already admitted, 500 for a
request whose engine step raised. A streamed request whose step raised gets an
``{"error": ...}`` event and the stream ends. A client that goes away aborts its request
(streamed: when the next chunk cannot be sent; otherwise within ``DISCONNECT_POLL_S``):
the engine thread frees its blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from attnplug.runner.api import responses as R
from attnplug.runner.api.engine_loop import EngineLoop, Submission
from attnplug.runner.api.metrics import ServerMetrics
from attnplug.runner.api.prepare import EngineRequest, ServedModel, chat_prompt, completion_prompt, engine_request
from attnplug.runner.api.protocol import ChatRequest, CompletionRequest, RequestError, error_body, unsupported, \
    validation_error
from attnplug.runner.api.text import TextStream

log = logging.getLogger("attnplug.api")

DISCONNECT_POLL_S = 0.1
"""A non-streamed request checks this often (seconds) whether its client is still there."""


@dataclass
class Outcome:
    """How a generation ended (data only): ``finish_reason`` (``"stop"`` or ``"length"``)
    and the output tokens it counts (``usage.completion_tokens``)."""

    finish_reason: str
    completion_tokens: int


class StepError(Exception):
    """The request's engine step raised (HTTP 500)."""


def create_app(served: ServedModel, engine, max_pending: int) -> FastAPI:
    """The application; the engine thread starts and stops with it (FastAPI's lifespan).

    Args:
        served: the model and the limits requests are checked against.
        engine: an ``LLMEngine`` that only this app steps.
        max_pending: requests admitted and not finished, at most (more: 503).
    """
    metrics = ServerMetrics(lambda: loop.stats)
    loop = EngineLoop(engine, max_pending, on_finish=metrics.on_finish)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="attnplug", lifespan=lifespan)
    app.state.engine_loop, app.state.served, app.state.metrics = loop, served, metrics
    _add_error_handlers(app)
    _add_info_routes(app, loop, served, metrics)
    _add_generation_routes(app, loop, served, engine)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """A refused request answers its OpenAI error object; anything else is a 500 naming the error."""

    @app.exception_handler(RequestError)
    async def _refused(_request, exc: RequestError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_server_error"),
                            status_code=500)


def _add_info_routes(app: FastAPI, loop: EngineLoop, served: ServedModel, metrics: ServerMetrics) -> None:
    """``/health``, ``/v1/models`` and ``/metrics``."""

    @app.get("/health")
    async def health():
        return Response(status_code=200 if loop.is_alive() else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "attnplug", "max_model_len": served.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_generation_routes(app: FastAPI, loop: EngineLoop, served: ServedModel, engine) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``: read the body, build the engine request, serve it."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _read(await request.body(), CompletionRequest)
        rid = f"cmpl-{uuid.uuid4().hex}"
        er = engine_request(req, completion_prompt(req, served), served, rid, "prompt")
        return await _serve(loop, served, engine, request, req, rid, er, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = _read(await request.body(), ChatRequest)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        er = engine_request(req, chat_prompt(req, served), served, rid, "messages")
        return await _serve(loop, served, engine, request, req, rid, er, chat=True)


async def _serve(loop: EngineLoop, served: ServedModel, engine, request: Request, req, rid: str,
                 er: EngineRequest, chat: bool):
    """Submit ``er`` and answer it: an SSE stream when ``req.stream``, else one body (499 when the
    client left first: its request is aborted and its blocks return)."""
    queue = _submit(loop, rid, er, engine.clock.now())
    created, n_prompt = int(time.time()), len(er.prompt_token_ids)
    gen = _generate(loop, served, rid, er, queue)
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        body = (_chat_stream if chat else _completion_stream)(gen, rid, created, served.name, n_prompt, include)
        return StreamingResponse(body, media_type="text/event-stream")
    text, end = [], None

    async def collect():
        nonlocal end
        async for piece, outcome in gen:
            text.append(piece)
            end = outcome or end

    try:
        if not await _unless_disconnected(request, collect()):
            await gen.aclose()  # the client went away: its request is aborted
            return Response(status_code=499)
    except StepError as e:
        raise RequestError(str(e), None, status=500, type_="internal_server_error") from None
    use = R.usage(n_prompt, end.completion_tokens)
    if chat:
        return R.chat_body(rid, created, served.name, "".join(text), end.finish_reason, use)
    return R.completion_body(rid, created, served.name, "".join(text), end.finish_reason, use)


async def _unless_disconnected(request: Request, work) -> bool:
    """Run ``work`` unless the client disconnects first (then ``work`` is cancelled);
    whether it ran to the end. Its exceptions propagate."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return False
    task.result()
    return True


def _read(body: bytes, model):
    """The body as ``model``, or a 400 naming the field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
    if (why := unsupported(req)) is not None:
        raise why
    return req


def _submit(loop: EngineLoop, rid: str, er: EngineRequest, arrival: float) -> asyncio.Queue:
    aio = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    sub = Submission(rid, er.prompt_token_ids, er.sampling_params, arrival,
                     lambda u: aio.call_soon_threadsafe(queue.put_nowait, u))
    if not loop.submit(sub):
        raise RequestError(f"the server is full: {loop.max_pending} requests are already admitted; retry later",
                           None, status=503, type_="service_unavailable_error", code="server_overloaded")
    return queue


async def _generate(loop: EngineLoop, served: ServedModel, rid: str, er: EngineRequest,
                    queue: asyncio.Queue) -> AsyncIterator[tuple[str, Outcome | None]]:
    """``(new text, None)`` as tokens arrive, then ``(last text, Outcome)``; aborts the
    request if the consumer stops early (a client went away) or a stop string appeared.

    Raises:
        StepError: the request's step raised.
    """
    text = TextStream(served.tokenizer.decode, er.stop)
    stops = er.sampling_params.stop_token_ids
    done = False
    try:
        while True:
            u = await queue.get()
            if u.error is not None:
                done = True
                raise StepError(u.error)
            piece = text.update(u.token_ids, final=u.finished)
            if text.stopped:
                done = True
                if not u.finished:
                    loop.abort(rid, reason="finished")
                yield piece, Outcome("stop", text.num_tokens_at_stop)
                return
            if u.finished:
                done = True
                reason = "stop" if text.ids and text.ids[-1] in stops else "length"
                yield piece, Outcome(reason, len(text.ids))
                return
            if piece:
                yield piece, None
    finally:
        if not done:
            loop.abort(rid)


async def _completion_stream(gen, rid: str, created: int, model: str, n_prompt: int, include_usage: bool):
    try:
        async for piece, end in gen:
            yield R.sse(R.completion_body(rid, created, model, piece, end.finish_reason if end else None, None))
            if end is not None and include_usage:
                yield R.sse(R.usage_completion_chunk(rid, created, model, R.usage(n_prompt, end.completion_tokens)))
    except StepError as e:
        yield R.sse(error_body(str(e), "internal_server_error"))
    yield R.sse("[DONE]")


async def _chat_stream(gen, rid: str, created: int, model: str, n_prompt: int, include_usage: bool):
    # The role rides on the first chunk with text, not a chunk of its own sent on receipt:
    # clients (vllm bench serve, AIPerf) time TTFT at the first chunk with ``choices`` and
    # take every later chunk as one inter-token gap.
    first = True
    try:
        async for piece, end in gen:
            delta = {"content": piece} if piece or end is None else {}
            if first:
                first, delta = False, {"role": "assistant", "content": piece}
            yield R.sse(R.chat_chunk(rid, created, model, delta, end.finish_reason if end else None))
            if end is not None and include_usage:
                yield R.sse(R.chat_chunk(rid, created, model, None, use=R.usage(n_prompt, end.completion_tokens)))
    except StepError as e:
        yield R.sse(error_body(str(e), "internal_server_error"))
    yield R.sse("[DONE]")
