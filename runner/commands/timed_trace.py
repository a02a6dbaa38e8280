"""Timed traces: one JSON object a line, ``{"timestamp", "input_length", "output_length",
"hash_ids"}`` — the Mooncake trace format, read by ``vllm bench serve --dataset-name
timed_trace`` (``vllm/benchmarks/datasets/datasets.py``, ``TimedTrace``).

* ``timestamp``: arrival, milliseconds (a number; only differences matter).
* ``input_length`` / ``output_length``: prompt and output tokens, ints in ``[1, 2**31 - 1]``;
  taken as they are (no scaling), and ``input_length + output_length`` must fit
  ``--max-model-len``.
* ``hash_ids`` (optional, default ``[]``): the prompt as blocks of ``chunk_size`` tokens
  (``--timed-trace-chunk-hash-size``, vLLM's flag and default, 16; Mooncake's traces use
  512). Equal ids are equal token blocks, so requests that share leading ids share a
  prefix. Block ``h``'s tokens are a ``numpy.random.default_rng([seed, 3_000_000, h])``
  stream; a prompt takes its blocks in order, cut to ``input_length`` (a last partial block
  is the first tokens of that block, so it is still a prefix of the full one — vLLM draws a
  partial block afresh), and tokens beyond its blocks are its own (a
  ``default_rng([seed, i])`` stream, as ``traces.make_prompts``). With real weights
  (``--model smollm2``) a block is instead ``chunk_size`` tokens of the prompt text (the
  bundled prompts, or ``--prompts``) from an offset that stream draws: text, and equal ids
  still equal blocks.

Other keys are ignored. A file is recognised by its ``.jsonl`` suffix (``--trace X.jsonl``).
A bad line is one message: ``FILE, line N: field 'F' ...`` (or ``--skip-invalid``).
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import numpy as np

from attnplug.core.errors import TraceFormatError
from attnplug.runner.commands.limits import clip
from attnplug.runner.commands.trace_fields import MAX_LINE_BYTES, MAX_TIMESTAMP_S, MAX_TOKENS
from attnplug.runner.commands.traces import LoadedTrace, TraceRequest

CHUNK_HASH_SIZE = 16
"""Default tokens per hash id (``vllm bench serve --timed-trace-chunk-hash-size``)."""

MAX_HASH_ID = 2**64 - 1


def is_timed_trace(name_or_path: str) -> bool:
    """A ``--trace`` value that names a timed-trace JSONL file (by its suffix)."""
    return str(name_or_path).lower().endswith(".jsonl")


def _int_field(obj: dict, key: str, low: int, high: int) -> int:
    value = obj.get(key)
    if value is None:
        raise ValueError(f"field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"field {key!r} must be an integer, got {clip(value)}")
    if not low <= value <= high:
        raise ValueError(f"field {key!r} must be in [{low}, {high}], got {value}")
    return value


def _parse_line(raw: bytes, max_model_len: int) -> tuple[float, int, int, list[int]] | None:
    """``(timestamp_ms, input_length, output_length, hash_ids)``, or ``None`` for a blank line."""
    if len(raw) > MAX_LINE_BYTES:
        raise ValueError(f"line longer than {MAX_LINE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not valid UTF-8") from None
    if not text.strip():
        return None
    try:
        obj: Any = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if ts is None:
        raise ValueError("field 'timestamp' is missing")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) \
            or abs(ts) > MAX_TIMESTAMP_S * 1000:
        raise ValueError(f"field 'timestamp' must be a finite number of milliseconds, got {clip(ts)}")
    n_in = _int_field(obj, "input_length", 1, MAX_TOKENS)
    n_out = _int_field(obj, "output_length", 1, MAX_TOKENS)
    hashes = obj.get("hash_ids", [])
    if not isinstance(hashes, list) or any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID
                                           for h in hashes):
        raise ValueError(f"field 'hash_ids' must be a list of integers in [0, 2**64 - 1], got {clip(hashes)}")
    if n_in + n_out > max_model_len:
        raise ValueError(f"fields 'input_length' + 'output_length' = {n_in} + {n_out} is longer than "
                         f"max_model_len={max_model_len}")
    return float(ts), n_in, n_out, hashes


class _Blocks:
    """The token blocks of hash ids (cached: a shared id is drawn once).

    Without ``corpus`` a block is ``chunk_size`` random ids; with ``corpus`` (token ids of
    real text) it is the ``chunk_size`` tokens of the corpus from an offset the same stream
    draws (wrapping around), so a real-weight model reads text."""

    def __init__(self, vocab_size: int, seed: int, chunk_size: int, corpus: Sequence[int] | None = None):
        self.vocab_size, self.seed, self.chunk_size = vocab_size, seed, chunk_size
        self.corpus = np.asarray(corpus, dtype=np.int64) if corpus else None
        self._cache: dict[int, list[int]] = {}

    def _draw(self, rng: np.random.Generator, size: int) -> list[int]:
        if self.corpus is None:
            return rng.integers(0, self.vocab_size, size=size).tolist()
        start = int(rng.integers(0, len(self.corpus)))
        return np.take(self.corpus, np.arange(start, start + size), mode="wrap").tolist()

    def prompt(self, i: int, hashes: list[int], n: int) -> list[int]:
        out: list[int] = []
        for h in hashes:
            if len(out) >= n:
                break
            if h not in self._cache:
                self._cache[h] = self._draw(np.random.default_rng([self.seed, 3_000_000, h]), self.chunk_size)
            out.extend(self._cache[h][: n - len(out)])
        if len(out) < n:
            own = self._draw(np.random.default_rng([self.seed, i]), n)
            out.extend(own[len(out):])
        return out


def load_timed_trace(path: str, num_requests: int | None, *, max_model_len: int, vocab_size: int, seed: int = 0,
                     chunk_size: int = CHUNK_HASH_SIZE, skip_invalid: bool = False,
                     corpus: Sequence[int] | None = None) -> tuple[LoadedTrace, list[list[int]]]:
    """The first ``num_requests`` valid lines of a timed trace, and their prompts.

    ``corpus``: token ids of real text; blocks and a prompt's own tokens are windows of it
    (:class:`_Blocks`) instead of random ids — for real weights (``text_requests.py``).

    Returns:
        ``(trace, prompts)``: ``trace[i].arrival_s`` is seconds after the first loaded
        request's timestamp; ``prompts[i]`` has ``trace[i].prompt_len`` token ids.

    Raises:
        TraceFormatError: an unreadable file, or (without ``skip_invalid``) a bad line:
            ``FILE, line N: field 'F' ...; fix the line, or pass --skip-invalid``.
    """
    if chunk_size < 1:
        raise TraceFormatError(f"chunk_size must be >= 1, got {chunk_size}")
    blocks = _Blocks(vocab_size, seed, chunk_size, corpus)
    reqs: list[TraceRequest] = []
    prompts: list[list[int]] = []
    skipped, first_skipped, t0 = 0, "", None
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot open trace: {e.strerror}") from None
    with fh:
        lineno = 0
        while num_requests is None or len(reqs) < num_requests:
            raw = fh.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            lineno += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while (more := fh.readline(MAX_LINE_BYTES)) and not more.endswith(b"\n"):
                    pass
            try:
                parsed = _parse_line(raw, max_model_len)
            except ValueError as e:
                message = f"{path}, line {lineno}: {e}"
                if not skip_invalid:
                    raise TraceFormatError(f"{message}; fix the line, or pass --skip-invalid to skip invalid "
                                           "lines") from None
                skipped += 1
                first_skipped = first_skipped or message
                continue
            if parsed is None:
                continue
            ts, n_in, n_out, hashes = parsed
            t0 = ts if t0 is None else t0
            prompts.append(blocks.prompt(len(reqs), hashes, n_in))
            reqs.append(TraceRequest(prompt_len=n_in, output_len=n_out, arrival_s=(ts - t0) / 1000.0))
    return LoadedTrace(tuple(reqs), skipped, path, 1.0, 0, first_skipped), prompts
