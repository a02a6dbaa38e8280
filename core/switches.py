"""The project's on/off environment switches, read one way everywhere.

Each ``ATTNPLUG_*`` switch below is ``1`` (on) or ``0`` (off); unset or empty means its
default. Anything else (``yes``, ``true``, ``2``, ``off``...) is refused with a
:class:`~attnplug.core.errors.ConfigError` naming the variable, rather than read as one
or the other: ``ATTNPLUG_CPU_PAGED_KERNEL=off`` must not leave the kernel on. The command
line checks them all before a command starts (``runner/commands/cli.py``: one line, exit 2);
a library caller meets the error where the switch is read.

Where each is read and what it turns (docs/configuration.md):

* ``ATTNPLUG_VALIDATE`` (off): the value checks of the step compiler, the builders and the
  cross-rank metadata check (docs/architecture.md);
* ``ATTNPLUG_NATIVE`` (on): the step compiler's compiled paths (``runner/step/fast``);
* ``ATTNPLUG_CPU_PAGED_KERNEL`` (on): ``cpu_sdpa``'s compiled paged kernel;
* ``ATTNPLUG_CPU_FUSED_OPS`` (on): the fused CPU elementwise ops (``runner/models/cpu_ops.py``);
* ``ATTNPLUG_CPU_PACKED_LINEAR`` (on, read at import): prepacked oneDNN CPU linears;
* ``ATTNPLUG_KEEP_HEAP`` (on): the model-running commands keep freed memory in glibc's heap
  (``runner/commands/heap.py``);
* ``ATTNPLUG_ONEDNN_DIRECT`` (on, read at the first linear call): those linears through
  oneDNN's C API directly (``runner/models/onednn.py``) rather than torch's op.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from attnplug.core.errors import ConfigError

SWITCHES: dict[str, bool] = {
    "ATTNPLUG_VALIDATE": False,
    "ATTNPLUG_NATIVE": True,
    "ATTNPLUG_CPU_PAGED_KERNEL": True,
    "ATTNPLUG_CPU_FUSED_OPS": True,
    "ATTNPLUG_CPU_PACKED_LINEAR": True,
    "ATTNPLUG_KEEP_HEAP": True,
    "ATTNPLUG_ONEDNN_DIRECT": True,
}
"""Every switch and its default (unset or empty)."""


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Switch ``name`` (a key of :data:`SWITCHES`) as set in ``environ`` (default ``os.environ``).

    Raises:
        ConfigError: the value is not ``0``, ``1`` or empty (surrounding blanks ignored).
        KeyError: ``name`` is not a switch.
    """
    default = SWITCHES[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return default
    value = raw.strip()
    if value == "1":
        return True
    if value == "0":
        return False
    if value == "":
        return default
    raise ConfigError(f"env {name}", f"{raw!r} is not a switch value: 1 (on), 0 (off) or unset "
                                     f"(default {'on' if default else 'off'})")


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Read every switch once; raises the first switch's :class:`ConfigError` (:func:`flag`)."""
    for name in SWITCHES:
        flag(name, environ)


__all__ = ["SWITCHES", "check_environment", "flag"]
