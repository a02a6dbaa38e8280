"""oneDNN's C API for the CPU linears, found and loaded once (``_onednn.pyx`` does the calls).

torch bundles oneDNN but exports none of its C API (``nm -D libtorch_cpu.so`` lists no
``dnnl_*``), and its own entry, ``torch.ops.mkldnn._linear_pointwise``, spends ~8-11 µs per
call building descriptors, attributes and a primitive-cache key through ideep (measured,
docs/performance.md, "Linears through oneDNN's C API (issue 38, session 15)"). The
``onednn-cpu-gomp`` wheel (oneDNN 3.2 built against GNU OpenMP; a base dependency on Linux
x86-64, pyproject.toml) puts ``libdnnl.so.3`` in the environment's ``lib/``; :func:`matmul_module`
finds it through the distribution's file list (``importlib.metadata``) and loads it with the
compiled ``_onednn`` module, whose :class:`~attnplug.runner.models._onednn.Matmul` holds a
packed weight and its primitives.

Absent any piece (no compiled module, no wheel, a library that fails to load, oneDNN not
3.x) or with ``ATTNPLUG_ONEDNN_DIRECT=0`` (:data:`ENV_SWITCH`, read once, at the first call),
:func:`matmul_module` returns ``None`` and the linears keep torch's op, silently:
:func:`load_error` says why.
"""

from __future__ import annotations

import importlib.metadata
import platform
from types import ModuleType

from attnplug.core import switches

try:
    from attnplug.runner.models import _onednn
except ImportError:  # not compiled (no C compiler at install): torch's op runs
    _onednn = None

ENV_SWITCH = "ATTNPLUG_ONEDNN_DIRECT"
"""``ATTNPLUG_ONEDNN_DIRECT=0`` keeps the CPU linears on torch's oneDNN op (as without the
wheel): for measuring one against the other. Read at the first linear call of the process."""

DISTRIBUTION = "onednn-cpu-gomp"
"""The PyPI distribution holding ``libdnnl.so.3`` (oneDNN 3.2, GNU OpenMP runtime)."""

LIBRARY = "libdnnl.so.3"
"""The file loaded: oneDNN 3's SONAME."""

_state: dict = {}  # "module": the loaded _onednn or None; "error": why None (str)


def library_path() -> str | None:
    """Where :data:`DISTRIBUTION` installed :data:`LIBRARY` (absolute path), ``None`` when
    the distribution or the file is missing."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == LIBRARY:
            path = dist.locate_file(f)
            return str(path.resolve()) if path.exists() else None
    return None


def _load() -> tuple[ModuleType | None, str]:
    if not switches.flag(ENV_SWITCH):
        return None, f"{ENV_SWITCH}=0"
    if _onednn is None:
        return None, "attnplug.runner.models._onednn is not compiled"
    if platform.system() != "Linux":
        return None, "the direct path loads libdnnl with dlopen (Linux only)"
    path = library_path()
    if path is None:
        return None, f"{DISTRIBUTION} is not installed ({LIBRARY} not found)"
    try:
        _onednn.load(path)
    except OSError as e:
        return None, f"{path}: {e}"
    return _onednn, ""


def matmul_module() -> ModuleType | None:
    """The loaded ``_onednn`` module (oneDNN's engine and stream created), or ``None`` when the
    direct path is off or unavailable (:func:`load_error`). Loads on the first call only."""
    if "module" not in _state:
        _state["module"], _state["error"] = _load()
    return _state["module"]


def load_error() -> str:
    """Why :func:`matmul_module` is ``None`` (``""`` when loaded or not tried yet)."""
    return _state.get("error", "")


def reset() -> None:
    """Forget the outcome of the load, so the next :func:`matmul_module` reads the switch and
    tries again (tests; a library loaded stays loaded: ``dlopen`` is once per process)."""
    _state.clear()


__all__ = ["DISTRIBUTION", "ENV_SWITCH", "LIBRARY", "library_path", "load_error", "matmul_module", "reset"]
