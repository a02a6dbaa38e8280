"""``--speculative`` integers are ASCII decimal, as every other flag (docs/configuration.md):
the review found ``ngram:k=٣`` (an Arabic-Indic digit, ``str.isdecimal``) accepted as k=3."""

from __future__ import annotations

import pytest

from attnplug.core.errors import AttnplugError
from attnplug.runner.execute.spec_decode.drafter import parse_speculative


@pytest.mark.parametrize("text", ["ngram:k=\u0663", "ngram:k=3,n=\uff13", "ngram:k=\u00b2"])
def test_non_ascii_digits_are_refused(text):
    with pytest.raises(AttnplugError, match="not a non-negative integer"):
        parse_speculative(text)


def test_ascii_digits_still_parse():
    assert parse_speculative("ngram:k=3,n=4,min_n=2").k == 3
