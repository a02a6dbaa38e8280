"""A checked request body to the engine's prompt and ``SamplingParams``, or a 400 naming the field.

Read once, checked in full, then handed over: nothing reaches the engine thread that its
admission checks (``runner/serve/admission.py``) would refuse. The mapping to the engine's
``SamplingParams`` (``runner/step/scheduler_output.py``):

* ``temperature`` (default 1, OpenAI's) → ``temperature`` (``0``: greedy);
* ``top_p`` → ``top_p``; ``top_k`` (``-1`` / ``0``: off, vLLM's) → ``top_k`` (``0``: off);
* ``seed`` → ``seed`` (the request's own generator: its tokens do not depend on its batch);
* ``max_tokens`` (chat: ``max_completion_tokens`` first) → ``max_tokens``; default
  ``max_model_len - prompt tokens`` (vLLM's default);
* the model's end-of-sequence token (unless ``ignore_eos``) and ``stop_token_ids`` →
  ``stop_token_ids``; ``stop`` strings are matched on the text (``text.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnplug.core.errors import InvalidRequestError
from attnplug.runner.api.protocol import ChatRequest, CompletionRequest, RequestError, SamplingFields
from attnplug.runner.serve.admission import check_new_request
from attnplug.runner.step.scheduler_output import SamplingParams


@dataclass
class EngineRequest:
    """What the engine runs for one HTTP request (data only).

    Attributes:
        prompt_token_ids: ``1 <= len < max_model_len``.
        sampling_params: the engine's, checked by ``check_new_request``.
        stop: the stop strings (may be empty).
    """

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stop: tuple[str, ...]


@dataclass
class ServedModel:
    """What the handlers need of the engine (data only).

    Attributes:
        name: the model id clients send (``/v1/models``).
        tokenizer: a ``ChatTokenizer`` (``encode``, ``encode_chat``, ``decode``, ``eos_token_id``).
        vocab_size: token ids of a prompt are ``< vocab_size``.
        scheduler_config / kv_cache_manager: what ``check_new_request`` checks against.
    """

    name: str
    tokenizer: object
    vocab_size: int
    scheduler_config: object
    kv_cache_manager: object

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len


def completion_prompt(req: CompletionRequest, served: ServedModel) -> list[int]:
    """The prompt's token ids (text through the tokenizer; ids checked against the vocabulary)."""
    if isinstance(req.prompt, str):
        return served.tokenizer.encode(req.prompt)
    bad = [t for t in req.prompt if not 0 <= t < served.vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {served.vocab_size})", "prompt")
    return list(req.prompt)


def chat_prompt(req: ChatRequest, served: ServedModel) -> list[int]:
    """The messages under the model's chat template, ready for the assistant's turn."""
    return served.tokenizer.encode_chat([{"role": m.role, "content": m.text()} for m in req.messages])


def engine_request(req: SamplingFields, prompt: list[int], served: ServedModel, req_id: str,
                   prompt_field: str) -> EngineRequest:
    """Check ``req`` against the engine and map it (module docstring).

    Raises:
        RequestError: 400 naming the field: an unknown model, an empty prompt or one of
            ``max_model_len`` tokens or more, ``max_tokens <= 0`` or past what
            ``max_model_len`` leaves, or what ``check_new_request`` refuses.
    """
    if req.model != served.name:
        raise RequestError(f"the model {req.model!r} does not exist; this server serves {served.name!r}", "model",
                           code="model_not_found")
    limit, n = served.max_model_len, len(prompt)
    if n == 0:
        raise RequestError("the prompt is empty (0 tokens)", prompt_field)
    if n >= limit:
        raise RequestError(f"this model's maximum context length is {limit} tokens; the prompt has {n} tokens, "
                           "which leaves no room for an output token", prompt_field)
    field, max_tokens = "max_tokens", req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        field, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if max_tokens is None:
        max_tokens = limit - n
    if max_tokens < 1:
        raise RequestError(f"{field} must be at least 1, got {max_tokens}", field)
    if max_tokens > limit - n:
        raise RequestError(f"this model's maximum context length is {limit} tokens; {n} in the prompt and "
                           f"{max_tokens} requested ({field}) exceed it", field)
    eos = served.tokenizer.eos_token_id
    stops = tuple(req.stop_token_ids or ()) + ((eos,) if eos is not None and not req.ignore_eos else ())
    sp = SamplingParams(temperature=1.0 if req.temperature is None else float(req.temperature),
                        top_k=max(0, req.top_k or 0), top_p=1.0 if req.top_p is None else float(req.top_p),
                        seed=req.seed, max_tokens=max_tokens, stop_token_ids=tuple(dict.fromkeys(stops)))
    try:
        check_new_request(served.scheduler_config, served.kv_cache_manager, (), req_id, prompt, sp)
    except InvalidRequestError as e:
        raise RequestError(str(e).split(": ", 1)[-1], None) from None
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return EngineRequest(prompt, sp, stop)
