"""Request traces for ``attnplug run``: the bundled Azure LLM traces or a user CSV.

Bundled data: Azure LLM inference traces 2023 (Azure Public Dataset,
``AzureLLMInferenceTrace_conv.csv`` / ``_code.csv``), CC-BY 4.0; cite Patel et al.,
"Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024. The
files and their attribution live in ``attnplug/runner/data/`` (see its README.md).

A trace is a CSV with a header naming at least the columns ``TIMESTAMP``,
``ContextTokens`` and ``GeneratedTokens`` (any order, extra columns ignored), one request
a row. ``TIMESTAMP`` is either ``YYYY-MM-DD HH:MM:SS[.fraction]`` or seconds as a number;
arrivals are reported relative to the first loaded row.

Scaling to the model. The Azure services ran models with a context of about
``SOURCE_MAX_MODEL_LEN = 8192`` tokens; a small test model has far less. Each length is
divided by ``scale`` and rounded to the nearest int (at least 1):
``prompt_len = max(1, round(ContextTokens / scale))``, likewise ``output_len``. With
``clamp`` a request still longer than ``max_model_len`` is cut:
``output_len = min(output_len, max_model_len // 2)``, then
``prompt_len = min(prompt_len, max_model_len - output_len)``, so
``prompt_len + output_len <= max_model_len`` and ``prompt_len < max_model_len``.
Defaults: the bundled traces use ``scale = max(1, SOURCE_MAX_MODEL_LEN / max_model_len)``
and ``clamp=True``; a user file uses ``scale = 1`` and ``clamp=False``, so its lengths are
taken as they are and a row longer than ``max_model_len`` is an error.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from importlib import resources
from typing import Iterator, Sequence

import numpy as np

from attnplug.core.errors import TraceFormatError
from attnplug.runner.commands.limits import clip
from attnplug.runner.commands.trace_fields import (
    BLANKS,
    MAX_FIELD_CHARS,
    MAX_LINE_BYTES,
    MAX_TIMESTAMP_S,
    MAX_TOKENS,
    BadLine,
    CsvLines,
    field_text,
    positive_int,
    parse_timestamp,
    shown,
)

BUNDLED_TRACES: dict[str, str] = {
    "conv": "azure_llm_2023_conv.csv",
    "code": "azure_llm_2023_code.csv",
}
"""Short name -> file in ``attnplug/runner/data``."""

BUNDLED_ATTRIBUTION = ("Azure LLM inference traces 2023 (Azure Public Dataset), CC-BY 4.0; Patel et al., "
                       "\"Splitwise: Efficient generative LLM inference using phase splitting\", ISCA 2024")
"""The line to print wherever figures or data from a bundled trace go (the licence asks for it)."""

SOURCE_MAX_MODEL_LEN = 8192
"""Context length the bundled traces' lengths are scaled down from (tokens)."""

REQUIRED_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, already scaled to the model.

    Attributes:
        prompt_len: prompt tokens, ``>= 1``.
        output_len: tokens to generate (``max_tokens``), ``>= 1``.
        arrival_s: arrival time in seconds after the first loaded request (``>= 0`` for
            time-ordered traces).
    """

    prompt_len: int
    output_len: int
    arrival_s: float


@dataclass(frozen=True)
class LoadedTrace(Sequence[TraceRequest]):
    """The loaded requests (a sequence of :class:`TraceRequest`) plus how they were read.

    Attributes:
        requests: the requests in file order.
        num_skipped: invalid rows skipped (only with ``skip_invalid=True``).
        source: the file read.
        scale: the divisor applied to the lengths.
        num_clamped: requests cut to fit ``max_model_len`` (only with ``clamp``).
        first_skipped: the one-line reason of the first skipped row (``""`` when none).
    """

    requests: tuple[TraceRequest, ...]
    num_skipped: int
    source: str
    scale: float
    num_clamped: int = 0
    first_skipped: str = ""

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, i):  # type: ignore[override]
        return self.requests[i]

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)


def resolve_trace_path(name_or_path: str) -> tuple[str, bool]:
    """Map ``conv`` / ``code`` to the bundled file, else treat the argument as a path.

    Returns:
        ``(path, is_bundled)``.

    Raises:
        TraceFormatError: not a bundled name and no such file.
    """
    if name_or_path in BUNDLED_TRACES:
        ref = resources.files("attnplug.runner.data").joinpath(BUNDLED_TRACES[name_or_path])
        return str(ref), True
    if not os.path.isfile(name_or_path):
        raise TraceFormatError(
            f"trace {name_or_path!r}: no such file; pass one of {', '.join(BUNDLED_TRACES)} or a CSV path")
    return name_or_path, False


@dataclass(frozen=True)
class _Scaling:
    max_model_len: int
    scale: float
    clamp: bool

    def lengths(self, ctx: int, gen: int) -> tuple[int, int, bool]:
        """``(prompt_len, output_len, clamped)`` per the module docstring's rule."""
        p = max(1, int(ctx / self.scale + 0.5))
        o = max(1, int(gen / self.scale + 0.5))
        if p + o <= self.max_model_len:
            return p, o, False
        if not self.clamp:
            raise ValueError(f"request of {p} prompt + {o} output tokens (after scale {self.scale:g}) "
                             f"is longer than max_model_len={self.max_model_len}")
        o = min(o, self.max_model_len // 2)
        return min(p, self.max_model_len - o), o, True


def _parse_row(row: list[str], width: int, col: dict[str, int], scaling: _Scaling):
    """``(timestamp, prompt_len, output_len, clamped)`` of one row (ValueError when invalid)."""
    if len(row) != width:
        raise ValueError(f"expected {width} fields, got {len(row)}")
    ts = parse_timestamp(field_text(row, col["TIMESTAMP"], "TIMESTAMP"))
    ctx = positive_int(field_text(row, col["ContextTokens"], "ContextTokens"), "ContextTokens")
    gen = positive_int(field_text(row, col["GeneratedTokens"], "GeneratedTokens"), "GeneratedTokens")
    return (ts, *scaling.lengths(ctx, gen))


def _read_header(reader, lines: CsvLines, path: str) -> list[str]:
    try:
        header = next(reader, None)
    except (BadLine, csv.Error) as e:
        raise TraceFormatError(f"{path}, line 1: header: {e}") from None
    names = [] if header is None else [h.strip(BLANKS) for h in header]
    bad = [h for h in names if any("\udc80" <= c <= "\udcff" for c in h)]
    if bad:
        raise TraceFormatError(f"{path}, line 1: header column {shown(bad[0])} is not valid UTF-8")
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise TraceFormatError(f"{path}, line 1: header {clip([shown(h) for h in names], 120)} lacks "
                               f"column(s) {missing}; a trace needs {','.join(REQUIRED_COLUMNS)}")
    lines.names = names
    return names


def load_trace(name_or_path: str, num_requests: int | None = None, *, max_model_len: int,
               scale: float | None = None, clamp: bool | None = None,
               skip_invalid: bool = False) -> LoadedTrace:
    """Read the first ``num_requests`` valid requests of a trace, scaled to the model.

    Rows after the ``num_requests``-th valid one are not read (nor checked). A row is
    invalid when a line is over :data:`MAX_LINE_BYTES` or a field over
    :data:`MAX_FIELD_CHARS`, a field is not valid UTF-8, the field count differs from the
    header's, the CSV syntax is broken, ``TIMESTAMP`` is neither form (or not finite, or
    over :data:`MAX_TIMESTAMP_S`), a length is not an ASCII decimal int in
    ``[1, MAX_TOKENS]``, or the request is longer than ``max_model_len`` (without
    ``clamp``).

    Args:
        name_or_path: ``"conv"``, ``"code"`` (bundled) or a CSV path.
        num_requests: how many requests to return; ``None`` for all.
        max_model_len: the model's context length (tokens).
        scale: divisor of both lengths (``>= 1`` shrinks); default per the module docstring.
        clamp: cut requests longer than ``max_model_len`` instead of rejecting them; default
            ``True`` for bundled traces, ``False`` for files.
        skip_invalid: skip (and count) every invalid row, whatever is wrong with it,
            instead of raising.

    Returns:
        A :class:`LoadedTrace` (a sequence of :class:`TraceRequest`, plus ``num_skipped``
        and ``first_skipped``, the message the first skipped row would have raised).

    Raises:
        TraceFormatError: unknown trace / missing or unreadable file, a header without the
            required columns, no request row (a header-only file, or every row skipped),
            or (without ``skip_invalid``) an invalid row. The message is
            one line: ``FILE, line N: FIELD what is wrong; how to fix`` (N counts the
            header as line 1; echoed values are cut to a few dozen characters).
    """
    if not isinstance(max_model_len, int) or max_model_len < 2:
        raise TraceFormatError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
    if num_requests is not None and num_requests < 0:
        raise TraceFormatError(f"num_requests must be >= 0, got {num_requests}")
    path, bundled = resolve_trace_path(name_or_path)
    scaling = _checked_scaling(max_model_len, scale, clamp, bundled)
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot open trace: {e.strerror}") from None
    with fh:
        out, skipped, clamped, first_skipped = _read_requests(fh, path, num_requests, scaling, skip_invalid)
    if not out and num_requests != 0:
        why = f"all {skipped} request rows were invalid and skipped" if skipped else "it has no request rows"
        raise TraceFormatError(f"{path}: {why} after the header (line 1), so there is nothing to run")
    return LoadedTrace(tuple(out), skipped, path, scaling.scale, clamped, first_skipped)


def _checked_scaling(max_model_len: int, scale: float | None, clamp: bool | None,
                     bundled: bool) -> _Scaling:
    """:func:`load_trace`'s scaling (``TraceFormatError`` for a bad ``scale``): ``scale``
    defaults to ``SOURCE_MAX_MODEL_LEN / max_model_len`` (at least 1) for a bundled trace and
    1 for a file; ``clamp`` to ``bundled``."""
    if scale is None:
        scale = max(1.0, SOURCE_MAX_MODEL_LEN / max_model_len) if bundled else 1.0
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise TraceFormatError(f"scale must be a positive finite number, got {scale!r}")
    return _Scaling(max_model_len, float(scale), bundled if clamp is None else clamp)


def _read_requests(fh, path, num_requests: int | None, scaling: _Scaling,
                   skip_invalid: bool) -> tuple[list[TraceRequest], int, int, str]:
    """The header, then rows until ``num_requests`` valid ones (or the end of the file).

    Returns ``(requests, rows skipped, requests clamped, the first skipped row's message)``;
    arrival times count from the first valid row. Raises ``TraceFormatError`` (one line:
    ``FILE, line N: what is wrong; how to fix``) on an invalid row unless ``skip_invalid``."""
    hint = "fix the row, or pass --skip-invalid to skip invalid rows"
    out: list[TraceRequest] = []
    skipped, clamped, first_skipped = 0, 0, ""
    t0: float | None = None
    lines = CsvLines(fh)
    reader = csv.reader(lines)
    header = _read_header(reader, lines, path)
    col = {c: header.index(c) for c in REQUIRED_COLUMNS}
    while num_requests is None or len(out) < num_requests:
        first_line = lines.num + 1
        try:
            try:
                row = next(reader)
            except StopIteration:
                break
            except BadLine as e:
                lineno = e.lineno
                raise ValueError(str(e)) from None
            except csv.Error as e:
                lineno = lines.num
                raise ValueError(f"not valid CSV: {e}") from None
            lineno = lines.num
            if not row or all(not f.strip(BLANKS) for f in row):
                continue  # blank lines are not requests
            ts, p, o, cut = _parse_row(row, len(header), col, scaling)
        except ValueError as e:
            where = f"line {lineno}" if lineno <= first_line else f"lines {first_line}-{lineno}"
            message = f"{path}, {where}: {e}"
            if not skip_invalid:
                raise TraceFormatError(f"{message}; {hint}") from None
            skipped += 1
            first_skipped = first_skipped or message
            continue
        clamped += cut
        if t0 is None:
            t0 = ts
        out.append(TraceRequest(prompt_len=p, output_len=o, arrival_s=ts - t0))
    return out, skipped, clamped, first_skipped


def make_prompts(trace_requests: Sequence[TraceRequest], vocab_size: int,
                 seed: int = 0) -> list[list[int]]:
    """Deterministic random prompts of the trace's lengths.

    Request ``i``'s tokens depend only on ``(seed, i)`` and its length (a numpy
    ``default_rng([seed, i])`` stream), not on other requests.

    Args:
        trace_requests: the requests (their ``prompt_len``).
        vocab_size: token ids are drawn uniformly from ``[0, vocab_size)``.
        seed: a non-negative int.

    Returns:
        One list of ``prompt_len`` token ids (Python ints) per request.

    Raises:
        TraceFormatError: ``vocab_size < 1`` or a negative seed.
    """
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise TraceFormatError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if not isinstance(seed, int) or seed < 0:
        raise TraceFormatError(f"seed must be a non-negative int, got {seed!r}")
    return [np.random.default_rng([seed, i]).integers(0, vocab_size, size=r.prompt_len).tolist()
            for i, r in enumerate(trace_requests)]
