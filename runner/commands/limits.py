"""Limits on what the commands read, and how they report a value out of them.

Shared by the subcommands (``run``, ``explain``, traces): bounded integer flags checked at
parse time, echoed values cut to a readable length, and the check that a buffer about to be
allocated fits the machine's memory. The limits themselves are listed in
``docs/configuration.md`` ("Limits on flags and files").
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

ECHO_CHARS = 60
"""At most this many characters of a bad value are echoed in an error message."""

MEMORY_FRACTION = 0.8
"""A buffer may take at most this fraction of the memory the OS reports available."""


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Help text with each option's default appended, ``(default: X)``, and the description
    and epilog printed as written. Defaults of ``None`` and ``False`` (an unset option, a
    flag) are not shown, nor is one the help text already mentions (``default``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit status 2):
    ``PROG: error: MESSAGE (PROG --help lists the options)``, without the usage block.
    Its help shows every option's default (:class:`DefaultsHelpFormatter`, unless another
    ``formatter_class`` is given)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def clip(value: object, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (``...`` and the full length appended).

    Args:
        value: anything; a ``str`` longer than ``limit`` is cut before ``repr`` so a huge
            string is never copied whole.
        limit: characters kept (int >= 1).

    Returns:
        A one-line string (``repr`` escapes newlines).
    """
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} {'chars' if isinstance(value, str) else 'bytes'})"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def bounded_int(low: int, high: int, *, what: str = "") -> Callable[[str], int]:
    """An ``argparse`` ``type=`` that accepts a decimal int in ``[low, high]``.

    Only ASCII digits with an optional sign (no ``1e6``, ``1_000``, ``0x10`` or full-width
    digits); anything else, or a value out of range, is an ``argparse.ArgumentTypeError``,
    which argparse prints as one usage line and exit status 2.
    """

    def parse(text: str) -> int:
        s = text.strip()
        body = s[1:] if s[:1] in "+-" else s
        if not body or len(body) > 19 or not (body.isascii() and body.isdigit()):
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}]{what}, got {clip(text)}")
        value = int(s)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be in [{low}, {high}]{what}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def available_memory_bytes() -> int | None:
    """Memory the OS says can be allocated now, in bytes; ``None`` when it cannot tell.

    Linux: ``MemAvailable`` of ``/proc/meminfo``; elsewhere ``os.sysconf``'s
    ``SC_AVPHYS_PAGES`` (else ``SC_PHYS_PAGES``) times ``SC_PAGE_SIZE``. No third-party
    package is used. CPU memory only: GPU pools are bounded by the device allocator.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for name in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            pages, size = os.sysconf(name), os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            continue
        if pages > 0 and size > 0:
            return pages * size
    return None


def memory_problem(what: str, nbytes: int, available: int | None = None) -> str | None:
    """Why allocating ``nbytes`` for ``what`` should not be tried, or ``None`` when it fits.

    Args:
        what: names the buffer, e.g. ``"the KV caches (--num-blocks 3000000)"``.
        nbytes: the size about to be allocated, bytes.
        available: bytes available (default :func:`available_memory_bytes`); when unknown
            nothing is refused.

    Returns:
        A one-line message naming the size, the memory available and the limit
        (:data:`MEMORY_FRACTION` of it), or ``None``.
    """
    if available is None:
        available = available_memory_bytes()
    if available is None or nbytes <= available * MEMORY_FRACTION:
        return None
    return (f"{what} need {nbytes / 2**30:.2f} GiB, more than {MEMORY_FRACTION:.0%} of the "
            f"{available / 2**30:.2f} GiB of memory available")


RUN_DEVICE_TYPES = ("cpu", "cuda")
"""Device types the engine runs on (``--device``)."""


def device_flag(text: str) -> str:
    """An ``argparse`` ``type=`` for ``--device``: ``cpu``, ``cuda`` or ``cuda:N``, and CUDA
    only where ``torch.cuda.is_available()`` (and ``N`` below the device count).

    Anything else is an ``argparse.ArgumentTypeError`` (one usage line, exit status 2),
    before a model or backend is built: ``--device tpu`` names the types accepted, ``--device
    cuda`` on a machine without CUDA says so in one line.
    """
    import torch

    try:
        dev_type = torch.device(text).type
    except (RuntimeError, TypeError, ValueError):
        dev_type = None
    if dev_type not in RUN_DEVICE_TYPES:
        raise argparse.ArgumentTypeError(f"{clip(text)}: attnplug runs on {' or '.join(RUN_DEVICE_TYPES)} "
                                         "(cuda:N for one GPU)")
    dev = torch.device(text)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: this machine has no CUDA (torch.cuda.is_available() is "
                                             "False); use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA "
                                             "device(s)")
    return text


device_flag.__name__ = "device"
