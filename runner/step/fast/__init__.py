"""The compiled fast paths (``runner/step/fast/_native.pyx``), when built and enabled.

``NATIVE`` is the extension module, or ``None`` when it is not built (it is an optional
extension: an install without a C compiler still works) or ``ATTNPLUG_NATIVE=0`` is set.
Every user keeps a numpy path that gives the same results, so ``None`` costs speed only;
the tests run both (``StepCompiler(native=False)``).
"""

from __future__ import annotations

from types import ModuleType

from attnplug.core import switches

_EXPECTED_API = 9


def load_native() -> ModuleType | None:
    """The extension, or ``None`` (not built, stale, or disabled by ``ATTNPLUG_NATIVE=0``)."""
    if not switches.flag("ATTNPLUG_NATIVE"):
        return None
    try:
        from attnplug.runner.step.fast import _native
    except ImportError:
        return None
    if getattr(_native, "NATIVE_API", None) != _EXPECTED_API:
        return None  # built from another version of the source: rebuild (`pip install -e .`; `make`
        # does it when runner/_native*.pyx or .pxi change). Bump NATIVE_API with any interface change.
    return _native


NATIVE: ModuleType | None = load_native()
