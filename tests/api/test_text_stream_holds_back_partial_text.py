"""``TextStream`` releases only final text: no half-written UTF-8 character, nothing that
could still become a stop string; the stop string and what follows never come out."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from attnplug.runner.api.byte_tokenizer import byte_tokenizer  # noqa: E402
from attnplug.runner.api.text import TextStream  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer(300)


def _feed(tok, text, stop=(), step=1):
    ids = tok.encode(text)
    s = TextStream(tok.decode, stop)
    out = [s.update(ids[i:i + step]) for i in range(0, len(ids), step)]
    out.append(s.update([], final=True))
    return out, s


def test_multibyte_characters_come_out_whole(tok):
    text = "naïve café ☕ done"
    out, _ = _feed(tok, text)
    assert "".join(out) == text
    assert all("\ufffd" not in piece for piece in out)
    assert len([p for p in out if p]) > 5  # one character at a time, not all at the end


def test_text_ends_before_the_stop_string(tok):
    out, s = _feed(tok, "hello world, stop here please", stop=("stop", "zzz"))
    assert "".join(out) == "hello world, "
    assert s.stopped and s.num_tokens_at_stop == len(tok.encode("hello world, stop"))
    # a prefix of a stop string is held back until it cannot match any more
    out, s = _feed(tok, "a sto b", stop=("stop",))
    assert "".join(out) == "a sto b" and not s.stopped
    held = TextStream(tok.decode, ("stop",))
    assert held.update(tok.encode("a st")) == "a "


def test_the_byte_tokenizer_round_trips_every_id(tok):
    ids = list(range(258, 300)) + tok.encode("ascii ünïcode")
    assert tok.encode(tok.decode(ids)) == ids
    assert tok.eos_token_id == 257 and tok.decode([257]) == ""
