"""The fields of a trace CSV (``runner/commands/traces.py``): bounded line reading and
strict number parsing.

Every check raises ``ValueError`` (or :class:`BadLine` for a line that cannot be a row)
with a message naming the column; ``load_trace`` prefixes the file and line number. The
limits are listed in ``docs/configuration.md`` ("Trace CSV").
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone

from attnplug.runner.commands.limits import clip

MAX_FIELD_CHARS = 128 * 1024
"""A field longer than this (characters) makes its row invalid (the ``csv`` module's own limit)."""

MAX_LINE_BYTES = 1024 * 1024
"""A line longer than this (bytes) makes its row invalid; it is never read whole into memory."""

MAX_TOKENS = 2**31 - 1
"""Largest ``ContextTokens`` / ``GeneratedTokens`` accepted (before scaling)."""

MAX_TIMESTAMP_S = 1e12
"""Largest ``|TIMESTAMP|`` in seconds accepted (about 31,700 years; keeps differences exact
to the microsecond)."""

_INT_RE = re.compile(r"[+-]?[0-9]{1,19}")
_NUM_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")
_DATE_RE = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2}) ([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,12}))?")
BLANKS = " \t\r\n"


class BadLine(Exception):
    """A physical line that cannot be a row (too long, a field too long); raised by :class:`CsvLines`."""

    def __init__(self, lineno: int, message: str):
        super().__init__(message)
        self.lineno = lineno


class CsvLines:
    """The file's lines for ``csv.reader``, read in pieces of at most :data:`MAX_LINE_BYTES`.

    Decodes UTF-8 with ``surrogateescape``, so an invalid byte becomes a lone surrogate
    (``U+DC80..U+DCFF``) that :func:`field_text` reports in the field that holds it. A line
    over the limit is skipped to its end and raised as :class:`BadLine`; the iterator
    goes on with the next line afterwards (``csv.reader`` resumes after an exception).
    """

    def __init__(self, fh, header_names: list[str] | None = None):
        self.fh, self.num, self.names = fh, 0, header_names

    def __iter__(self):
        return self

    def __next__(self) -> str:
        raw = self.fh.readline(MAX_LINE_BYTES + 1)
        if not raw:
            raise StopIteration
        self.num += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (more := self.fh.readline(MAX_LINE_BYTES)) and not more.endswith(b"\n"):
                pass
            raise BadLine(self.num, f"line longer than {MAX_LINE_BYTES} bytes")
        if self.num == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte-order mark (spreadsheet exports)
        line = raw.decode("utf-8", "surrogateescape")
        if len(line) > MAX_FIELD_CHARS:
            for i, piece in enumerate(line.split(",")):
                if len(piece) > MAX_FIELD_CHARS:
                    name = self.names[i] if self.names and i < len(self.names) else f"field {i + 1}"
                    raise BadLine(self.num, f"{shown(name)} is longer than {MAX_FIELD_CHARS} characters")
        return line


def shown(text: str, limit: int = 40) -> str:
    """A column name or value as echoed in a message: at most ``limit`` characters, invalid
    bytes shown as ``\\xNN``."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


def field_text(row: list[str], i: int, column: str) -> str:
    """Field ``i`` of ``row`` without surrounding blanks.

    Raises:
        ValueError: it holds bytes that were not valid UTF-8 (named ``column``).
    """
    value = row[i]
    if any("\udc80" <= c <= "\udcff" for c in value):
        raise ValueError(f"{column} is not valid UTF-8: '{shown(value)}'")
    return value.strip(BLANKS)


def parse_timestamp(text: str) -> float:
    """Seconds (float) from ``YYYY-MM-DD HH:MM:SS[.fraction]`` (UTC) or a plain decimal
    number (ASCII digits; no ``nan``, ``inf``, ``1_2``); finite, ``|t| <= MAX_TIMESTAMP_S``.

    Raises:
        ValueError: anything else (the message says what).
    """
    if _NUM_RE.fullmatch(text):
        value = float(text)
        if not math.isfinite(value) or abs(value) > MAX_TIMESTAMP_S:
            raise ValueError(f"TIMESTAMP {clip(text)} is out of range: seconds must be finite and at most "
                             f"{MAX_TIMESTAMP_S:g} in magnitude")
        return value
    m = _DATE_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"TIMESTAMP {clip(text)} is neither 'YYYY-MM-DD HH:MM:SS[.f]' nor seconds")
    try:
        dt = datetime(*(int(g) for g in m.groups()[:6]), tzinfo=timezone.utc)
    except ValueError as e:
        raise ValueError(f"TIMESTAMP {clip(text)} is not a valid date and time ({e})") from None
    frac = m.group(7)
    return dt.timestamp() + (int(frac) / 10 ** len(frac) if frac else 0.0)


def positive_int(text: str, column: str) -> int:
    """A length: ASCII decimal digits, ``1 <= value <= MAX_TOKENS``.

    Raises:
        ValueError: not such an int (``1e3``, ``1_2``, full-width digits...), or out of range.
    """
    if not _INT_RE.fullmatch(text):
        raise ValueError(f"{column} must be an integer, got {clip(text)} (ASCII decimal digits only)")
    value = int(text)
    if value <= 0:
        raise ValueError(f"{column} must be positive, got {value}")
    if value > MAX_TOKENS:
        raise ValueError(f"{column} must be at most {MAX_TOKENS}, got {value}")
    return value
