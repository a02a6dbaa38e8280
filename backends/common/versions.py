"""Comparing the version strings of installed kernel packages."""

from __future__ import annotations

import re


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading numeric parts of a version string, local and pre-release tags dropped.

    Examples:
        >>> version_tuple("2.6.3+cu124torch2.4")
        (2, 6, 3)
        >>> version_tuple("0.6.18.post1")
        (0, 6, 18)
        >>> version_tuple("2.7.0rc1")
        (2, 7, 0)
        >>> version_tuple("unknown")
        ()
    """
    parts = []
    for p in text.split("+")[0].split("."):
        lead = re.match(r"\d+", p)
        if lead is None:
            break
        parts.append(int(lead.group()))
        if lead.end() < len(p):  # "0rc1": the pre-release ends the comparable part
            break
    return tuple(parts)
