"""Drafters: who proposes the draft tokens a step verifies, and how ``--speculative`` is read.

A drafter has one method, ``propose(token_histories, k)``: for each request, given every
token it holds so far (prompt + outputs, oldest first), up to ``k`` token ids it guesses come
next. The target model then verifies them in one step (``rejection_sampler.py``).

``NgramDrafter`` is prompt lookup (vLLM's ``ngram`` method, here written from its
description): no extra model, the request's own history is the draft source. Its drafts are
deterministic, so the rejection sampler treats them as a one-hot draft distribution
(``q(x) = 1`` for the proposed ``x``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from attnplug.core.errors import ConfigError, MetadataError

DEFAULT_MAX_N = 3
"""Longest suffix the n-gram drafter tries to match when ``n=`` is not given."""
DEFAULT_MIN_N = 1
"""Shortest suffix it falls back to when ``min_n=`` is not given."""


class Drafter(Protocol):
    """Anything that proposes draft tokens per request."""

    def propose(self, token_histories: Sequence[Sequence[int]], k: int | Sequence[int],
                req_ids: Sequence[str] | None = None) -> list[list[int]]:
        """Up to ``k`` draft token ids per request (``k`` one int for all, or one per request;
        ``req_ids`` name the requests, for a drafter that keeps state per request)."""
        ...


def _per_request_k(k: int | Sequence[int], num_reqs: int) -> list[int]:
    if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
        ks = [int(k)] * num_reqs
    else:
        ks = [int(x) for x in k]
        if len(ks) != num_reqs:
            raise MetadataError(f"k has {len(ks)} entries for {num_reqs} requests")
    for i, x in enumerate(ks):
        if x < 0:
            raise MetadataError(f"k must be >= 0, got {x} for request {i}")
    return ks


class NgramDrafter:
    """Prompt-lookup drafting: continue the most recent earlier occurrence of the suffix.

    For each request, for ``n`` from ``max_n`` down to ``min_n``: take the last ``n`` tokens
    of the history; find the latest start ``s`` of the same ``n`` tokens *before* that suffix
    (``s < len(history) - n``); if there is one, propose ``history[s + n : s + n + k]`` (at most
    ``k`` tokens, fewer when the match is close to the end; the continuation may run into the
    suffix itself, which is what makes periodic text draft well). The first ``n`` that matches
    wins; no match at any ``n`` (or ``k == 0``) proposes nothing.

    Args:
        max_n: longest suffix to match, ``>= 1``.
        min_n: shortest suffix to match, ``1 <= min_n <= max_n``.

    Raises:
        MetadataError: on bad ``max_n`` / ``min_n``.
    """

    def __init__(self, max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N):
        if min_n < 1 or max_n < min_n:
            raise MetadataError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n

    def propose_one(self, history: Sequence[int], k: int) -> list[int]:
        """Drafts for one request: ``history`` is its token ids (any int sequence or 1-D array;
        an ``int64`` array is used as is). Cost: one comparison pass over the history for the
        last token, then a few passes over the positions that hold it."""
        if k <= 0:
            return []
        h = np.asarray(history, dtype=np.int64)
        if h.ndim != 1:
            raise MetadataError(f"a token history must be 1-D, got shape {h.shape}")
        length = h.shape[0]
        top = min(self.max_n, length - 1)
        if top < self.min_n:
            return []
        # Candidates: earlier positions c <= length - 2 holding the last token; then how far
        # each one's match with the suffix extends backwards (at most ``top`` tokens). One
        # pass over the history, then work on the (few) candidates only.
        cand = np.flatnonzero(h[:-1] == h[-1])
        if cand.size == 0:
            return []
        matched = np.ones(cand.shape[0], dtype=np.int64)
        alive = np.ones(cand.shape[0], dtype=bool)
        for j in range(1, top):
            alive &= (cand >= j) & (h[np.maximum(cand - j, 0)] == h[length - 1 - j])
            if not alive.any():
                break
            matched += alive
        for n in range(top, self.min_n - 1, -1):
            hits = cand[matched >= n]
            if hits.size:
                start = int(hits[-1]) + 1  # the latest match ending at c continues at c + 1
                return h[start:start + k].tolist()
        return []

    def propose(self, token_histories: Sequence[Sequence[int]], k: int | Sequence[int],
                req_ids: Sequence[str] | None = None) -> list[list[int]]:
        """Drafts per request.

        Args:
            token_histories: per request, its token ids so far (prompt then outputs).
            req_ids: ignored (the n-gram drafter keeps no state).
            k: the most drafts per request; one ``int`` for all or one per request (the
                caller caps it by the token budget and ``max_model_len``).

        Returns:
            One ``list[int]`` per request, ``len <= k`` (empty: no draft this step).

        Raises:
            MetadataError: ``k`` negative or of the wrong length; a history that is not 1-D.
        """
        ks = _per_request_k(k, len(token_histories))
        return [self.propose_one(h, kk) for h, kk in zip(token_histories, ks)]


@dataclass(frozen=True)
class SpeculativeConfig:
    """A parsed ``--speculative`` value.

    Attributes:
        method: ``"ngram"`` or ``"draft"`` (a draft model, ``draft_model.py``).
        k: drafts proposed per request per step (``num_speculative_tokens`` in vLLM), ``>= 1``.
        max_n, min_n: the n-gram drafter's suffix lengths (see ``NgramDrafter``).
        model: ``draft``: the draft model (a preset name or an HF ``config.json`` path).
        drafter: ``draft``: the built ``DraftModelDrafter``, injected by whoever builds the
            engine (``runner/commands/draft_setup.py``), since building a model is not this
            layer's job; not compared.
    """

    method: str
    k: int
    max_n: int = DEFAULT_MAX_N
    min_n: int = DEFAULT_MIN_N
    model: str | None = None
    drafter: Any = field(default=None, compare=False, repr=False)

    def make_drafter(self) -> Any:
        """The drafter this configuration describes.

        Raises:
            ConfigError: ``draft`` without an injected drafter.
        """
        if self.method == "draft":
            if self.drafter is None:
                raise ConfigError("--speculative", "the draft model was not built (build the engine with "
                                  "runner/commands/assemble.build_engine, which loads it)")
            return self.drafter
        return NgramDrafter(max_n=self.max_n, min_n=self.min_n)


_KEYS = {"ngram": ("k", "n", "min_n"), "draft": ("k", "model")}
_EXAMPLE = {"ngram": "'ngram:k=3'", "draft": "'draft:k=3,model=PATH/config.json'"}


def _read_items(rest: str, method: str, origin: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for item in (rest.split(",") if rest.strip() else []):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq:
            raise ConfigError(origin, f"{item.strip()!r} is not key=value")
        if key not in _KEYS[method]:
            raise ConfigError(origin, f"unknown key {key!r} for {method} (known: {', '.join(_KEYS[method])})")
        if key in values:
            raise ConfigError(origin, f"key {key!r} given twice")
        if key != "model" and not (raw.isascii() and raw.isdecimal()):
            raise ConfigError(origin, f"{key}={raw!r} is not a non-negative integer")
        values[key] = raw
    if "k" not in values:
        raise ConfigError(origin, f"{method} needs k (drafts per step), e.g. {_EXAMPLE[method]}")
    if int(values["k"]) < 1:
        raise ConfigError(origin, f"k must be >= 1, got {values['k']}")
    return values


def parse_speculative(text: str, origin: str = "--speculative") -> SpeculativeConfig:
    """Read ``METHOD:key=value,...``, e.g. ``ngram:k=3``, ``ngram:k=4,n=5,min_n=2`` or
    ``draft:k=3,model=PATH/config.json``.

    Keys for ``ngram``: ``k`` (required, ``>= 1``), ``n`` (= ``max_n``, default
    ``DEFAULT_MAX_N``), ``min_n`` (default ``min(DEFAULT_MIN_N, n)``); decimal ints.
    Keys for ``draft``: ``k`` (required, ``>= 1``) and ``model`` (required: a preset name or
    a path to an HF ``config.json``, not checked here; no commas in it).

    Args:
        text: the value as the user wrote it.
        origin: where it came from, for the error (``"--speculative"``, a toml path...).

    Raises:
        ConfigError: one line naming ``origin`` and what is wrong (unknown method, unknown or
            repeated key, a missing ``=``, a value that is not an int or is out of range, a
            missing or empty ``model``).
    """
    if not isinstance(text, str):
        raise ConfigError(origin, f"expected a string like 'ngram:k=3', got {type(text).__name__}")
    method, sep, rest = text.strip().partition(":")
    method = method.strip()
    if method not in _KEYS:
        raise ConfigError(origin, f"unknown speculative method {method!r} (known: ngram, draft); "
                                  "expected e.g. 'ngram:k=3' or 'draft:k=3,model=PATH/config.json'")
    values = _read_items(rest if sep else "", method, origin)
    k = int(values["k"])
    if method == "draft":
        if not values.get("model"):
            raise ConfigError(origin, "draft needs model=PATH/config.json (or a preset name), "
                                      "e.g. 'draft:k=3,model=tiny-llama'")
        return SpeculativeConfig(method="draft", k=k, model=values["model"])
    max_n = int(values.get("n", DEFAULT_MAX_N))
    min_n = int(values.get("min_n", min(DEFAULT_MIN_N, max_n)))
    if max_n < 1:
        raise ConfigError(origin, f"n must be >= 1, got {max_n}")
    if not 1 <= min_n <= max_n:
        raise ConfigError(origin, f"min_n must be in 1..n={max_n}, got {min_n}")
    return SpeculativeConfig(method="ngram", k=k, max_n=max_n, min_n=min_n)
