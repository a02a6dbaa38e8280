"""Prompts as text for real-weight runs (``attnplug run --model smollm2``, ``--prompts FILE``).

A prompts file is JSON Lines, one request a line, each an object with

* ``"prompt"``: a string (sent as one user turn through the model's chat template, as
  ``vllm bench serve`` does with custom datasets), or ``"messages"``: a list of
  ``{"role": "system" | "user" | "assistant", "content": str}`` (a conversation so far);
  exactly one of the two;
* optional ``"max_tokens"``: an int in ``[1, 1048576]`` (default: the trace row's output length);
* optional ``"id"``, ``"kind"``, ``"group"``: strings, reported with the completion.

Blank lines are skipped. A bad line is a :class:`~attnplug.core.errors.TraceFormatError`
naming the file, the line and the field (the CLI prints it, exit 2). The bundled set
(``runner/data/prompts.jsonl``, :data:`BUNDLED_PROMPTS`) is in the same format: a few hundred
prompts written for this project — questions, instructions, code, summaries of a given
paragraph, multi-turn conversations, and groups that share a long system prompt —
interleaved so that the first requests mix every kind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any, Sequence

from attnplug.core.errors import TraceFormatError
from attnplug.runner.commands.limits import clip

BUNDLED_PROMPTS = "prompts.jsonl"
"""The bundled prompt set, a file of ``attnplug/runner/data``."""

ROLES = ("system", "user", "assistant")
MAX_LINE_CHARS = 1 << 20
"""A line longer than this (characters) is refused."""


@dataclass(frozen=True)
class TextPrompt:
    """One request of a prompts file (data only).

    Attributes:
        messages: the conversation, ``[{"role", "content"}, ...]`` (a ``"prompt"`` line is
            one user message).
        max_tokens: the line's ``max_tokens``, ``None`` when it gives none.
        id, kind, group: the line's labels (``""`` when absent).
    """

    messages: tuple[dict[str, str], ...]
    max_tokens: int | None = None
    id: str = ""
    kind: str = ""
    group: str = ""

    @property
    def last_user_text(self) -> str:
        """The last user turn's text (what a table shows as "the prompt")."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


def _messages(value: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise TraceFormatError(f"{where}: \"messages\" must be a non-empty list of {{role, content}} objects")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or not {"role", "content"} <= set(m):
            raise TraceFormatError(f"{where}: messages[{j}] must be an object with exactly \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise TraceFormatError(f"{where}: messages[{j}].role must be one of {', '.join(ROLES)}, got {clip(m['role'])}")
        if not isinstance(m["content"], str):
            raise TraceFormatError(f"{where}: messages[{j}].content must be a string")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def parse_line(obj: Any, where: str) -> TextPrompt:
    """One decoded line as a :class:`TextPrompt` (``where`` prefixes errors)."""
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: a line must be a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - {"prompt", "messages", "max_tokens", "id", "kind", "group"}
    if unknown:
        raise TraceFormatError(f"{where}: unknown field {clip(sorted(unknown)[0])} (fields: prompt or messages, "
                               "max_tokens, id, kind, group)")
    if ("prompt" in obj) == ("messages" in obj):
        raise TraceFormatError(f"{where}: give exactly one of \"prompt\" (a string) and \"messages\" (a list)")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise TraceFormatError(f"{where}: \"prompt\" must be a non-empty string")
        messages = ({"role": "user", "content": obj["prompt"]},)
    else:
        messages = _messages(obj["messages"], where)
    mt = obj.get("max_tokens")
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or not 1 <= mt <= 1 << 20):
        raise TraceFormatError(f"{where}: \"max_tokens\" must be an integer in [1, {1 << 20}], got {clip(mt)}")
    labels = {}
    for key in ("id", "kind", "group"):
        if key in obj and not isinstance(obj[key], str):
            raise TraceFormatError(f"{where}: \"{key}\" must be a string")
        labels[key] = obj.get(key, "")
    return TextPrompt(messages, mt, **labels)


def load_prompts(path: str | None, limit: int | None = None) -> list[TextPrompt]:
    """The first ``limit`` prompts (all when ``None``) of ``path``, or of the bundled set
    when ``path`` is ``None``.

    Raises:
        TraceFormatError: the file cannot be read, or a line is not a valid request
            (``FILE, line N: what is wrong``), or it holds no request.
    """
    if path is None:
        source = resources.files("attnplug.runner.data").joinpath(BUNDLED_PROMPTS)
        name = f"attnplug/runner/data/{BUNDLED_PROMPTS}"
    else:
        source, name = path, path
    out: list[TextPrompt] = []
    try:
        with open(source, encoding="utf-8") if path else source.open("r", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if limit is not None and len(out) >= limit:
                    break
                where = f"{name}, line {lineno}"
                if len(line) > MAX_LINE_CHARS:
                    raise TraceFormatError(f"{where}: longer than {MAX_LINE_CHARS} characters")
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceFormatError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
                out.append(parse_line(obj, where))
    except OSError as e:
        raise TraceFormatError(f"{name}: cannot read the prompts file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not out:
        raise TraceFormatError(f"{name}: no request in the file (one JSON object a line)")
    return out


def cycled(prompts: Sequence[TextPrompt], n: int) -> list[TextPrompt]:
    """``n`` prompts: ``prompts`` repeated in order as often as needed."""
    return [prompts[i % len(prompts)] for i in range(n)]


__all__ = ["BUNDLED_PROMPTS", "TextPrompt", "cycled", "load_prompts", "parse_line"]
