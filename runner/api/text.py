"""Token ids to text as a request streams: held-back partial characters and stop strings.

OpenAI's ``stop`` is up to four strings; the text returned ends before the first one that
appears, and the request finishes there (``finish_reason: "stop"``), as in vLLM, where the
detokenizer checks the strings and the engine aborts the request. :class:`TextStream`
decodes all output ids so far on each update (a byte-level BPE can join bytes across
tokens, so a suffix decoded alone could be wrong) and releases only the text that is
final: never a trailing ``U+FFFD`` (the bytes of a character not complete yet) and never
a suffix that could still grow into a stop string.
"""

from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """The text of one request's outputs, released in increments.

    Args:
        decode: ``ids -> str`` (the model's tokenizer, special tokens skipped).
        stop: the stop strings (non-empty strings).
    """

    def __init__(self, decode, stop: Sequence[str] = ()):
        self._decode = decode
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.sent = 0
        """Characters of the text released so far."""
        self.stopped = False
        """A stop string appeared: the text ends before it and nothing more comes."""
        self.num_tokens_at_stop: int | None = None
        """Output tokens generated when the stop string appeared (``usage`` counts them)."""

    def update(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Add ``new_ids``; returns the text now safe to release (``final``: all of it).

        After a stop string, further ids are ignored and ``""`` is returned.
        """
        if self.stopped:
            return ""
        self.ids.extend(int(t) for t in new_ids)
        text = self._decode(self.ids)
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped, self.num_tokens_at_stop = True, len(self.ids)
            return self._release(text[:cut])
        if not final:
            text = text.rstrip(REPLACEMENT) if text.endswith(REPLACEMENT) else text
            text = text[: len(text) - self._held_back(text)]
        return self._release(text)

    def _release(self, text: str) -> str:
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out

    def _first_stop(self, text: str) -> int | None:
        """Where the earliest stop string starts in ``text``, looking only where it could be new."""
        best = None
        for s in self.stop:
            i = text.find(s, max(0, self.sent - len(s) + 1))
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        n = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), n, -1):
                if text.endswith(s[:k]):
                    n = k
                    break
        return n
