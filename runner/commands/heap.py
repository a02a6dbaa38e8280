"""The process's heap policy: freed memory stays in glibc's heap for the next step.

A prefill step's forward allocates and frees temporaries of several MB per layer (tiny-llama,
2,048 rows: the ``[2048, 1024]`` gate/up product is 8 MB; SmolLM2, 1,246 rows: 15 MB). With
glibc's defaults a free chunk above ``M_TRIM_THRESHOLD`` at the top of the heap goes back to
the kernel (and a request above ``M_MMAP_THRESHOLD`` gets its own mapping, unmapped at free),
so the next layer's allocation faults every 4 KiB page in again and the kernel zeroes it:
18,000–36,000 minor page faults in each tiny-llama ``bench engine`` run's prefill steps, none
in its decode steps (docs/performance.md, "The heap kept between steps"). vLLM's CPU
installation guide recommends preloading TCMalloc for allocation performance; this module
sets glibc's own options instead, through ``mallopt(3)``:

* ``M_MMAP_THRESHOLD`` = :data:`MMAP_THRESHOLD` (32 MiB: the ceiling glibc's own sliding
  threshold may rise to on 64-bit, ``DEFAULT_MMAP_THRESHOLD_MAX``), which also turns that
  sliding off;
* ``M_TRIM_THRESHOLD`` = :data:`TRIM_THRESHOLD` (512 MiB of free memory at the heap's top
  before any goes back);
* ``M_TOP_PAD`` = :data:`TOP_PAD` (64 MiB more asked of the kernel each time the heap grows).

The cost: after a large prefill the process keeps up to :data:`TRIM_THRESHOLD` of freed
memory mapped (its RSS does not shrink back). ``ATTNPLUG_KEEP_HEAP=0`` leaves glibc's
defaults (``core/switches.py``). Only the ``attnplug`` commands that run models set it
(``runner/commands/cli.py``); a library caller may call :func:`keep_freed_memory` itself.
Values are mallopt's parameter numbers in glibc's ``malloc.h``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Mapping

from attnplug.core import switches

SWITCH = "ATTNPLUG_KEEP_HEAP"
"""The on/off switch (default on; ``core/switches.py``)."""

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
"""``mallopt`` parameter numbers (glibc ``malloc.h``)."""

MMAP_THRESHOLD = 32 << 20
"""Bytes: requests at or above this get their own mapping (32 MiB)."""

TRIM_THRESHOLD = 512 << 20
"""Bytes of free memory at the heap's top kept before it is given back (512 MiB)."""

TOP_PAD = 64 << 20
"""Bytes asked of the kernel beyond a request each time the heap grows (64 MiB)."""


def _glibc_mallopt():
    """glibc's ``mallopt``, or ``None`` off glibc (musl, macOS): it has no such options."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # glibc only  # noqa: B018
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Set the three options above (module docstring) unless ``ATTNPLUG_KEEP_HEAP=0`` in
    ``environ`` (default ``os.environ``) or the C library is not glibc. Returns whether all
    three were taken (``mallopt`` returns 1 for each).

    Raises:
        ConfigError: ``ATTNPLUG_KEEP_HEAP`` is not ``0``, ``1`` or empty.
    """
    if not switches.flag(SWITCH, environ):
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    taken = [mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD), mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD),
             mallopt(M_TOP_PAD, TOP_PAD)]
    return all(t == 1 for t in taken)


__all__ = ["MMAP_THRESHOLD", "SWITCH", "TOP_PAD", "TRIM_THRESHOLD", "keep_freed_memory"]
