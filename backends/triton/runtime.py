"""Where the Triton kernels can run, and loading them in the right mode.

Triton decides at *decoration* time (``@triton.jit``, i.e. when a kernel module is
imported) whether a kernel is compiled for the GPU or run by the interpreter on the CPU:
the installed Triton reads ``TRITON_INTERPRET`` through ``triton.knobs.runtime.interpret``
then. Importing ``triton`` itself is harmless. So that the environment variable can be
set at any point before the first launch (a test's conftest, a CLI wrapper), the kernel
modules of this package are never imported at package import time: :func:`kernel_module`
imports them on first use, and if the mode has changed since (the variable was set or
cleared after a first import) it loads a second copy of the module decorated in the
current mode. Both copies live side by side; each launch uses the copy of the current
mode.

Nothing here imports ``triton`` at module import time: the backend class must load (and
report itself unavailable) on machines without Triton.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

_PACKAGE = "attnplug.backends.triton"
_INTERPRETED_SUFFIX = "_interpreted"


def triton_import_error() -> str | None:
    """``None`` when ``import triton`` works, else why it does not (one line)."""
    if "triton" in sys.modules:
        return None
    try:
        importlib.import_module("triton")
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"importing triton failed ({type(exc).__name__}: {exc})"
    return None


def interpreting() -> bool:
    """True when kernels decorated now would run in the Triton interpreter.

    Reads ``TRITON_INTERPRET`` the way the installed Triton does (through
    ``triton.knobs`` when available, else the environment variable). Never raises; False
    without Triton.
    """
    if triton_import_error() is not None:
        return False
    try:
        import triton

        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older Triton without knobs: it read the variable directly
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, never raising."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def unavailable_reason() -> str | None:
    """``None`` when the Triton kernels can run here, else a sentence saying why not."""
    why = triton_import_error()
    if why is not None:
        return f"{why}; install it with `pip install 'attnplug[triton]'`"
    if cuda_available() or interpreting():
        return None
    return "no CUDA device (on the CPU, set TRITON_INTERPRET=1: Triton interpreter, slow)"


def kernel_module(name: str) -> ModuleType:
    """The kernel module ``attnplug.backends.triton.<name>`` decorated in the current mode.

    Args:
        name: ``"attention_kernels"`` or ``"cache_kernels"``.

    Returns:
        The module whose ``INTERPRETED`` attribute equals :func:`interpreting` now.

    Raises:
        ImportError: Triton is not importable.
    """
    full = f"{_PACKAGE}.{name}"
    want = interpreting()
    module = sys.modules.get(full) or importlib.import_module(full)
    if module.INTERPRETED == want:
        return module
    alt_name = full + _INTERPRETED_SUFFIX if want else full + "_compiled"
    alt = sys.modules.get(alt_name)
    if alt is None or alt.INTERPRETED != want:
        spec = importlib.util.spec_from_file_location(alt_name, module.__file__)
        alt = importlib.util.module_from_spec(spec)
        sys.modules[alt_name] = alt
        spec.loader.exec_module(alt)
    return alt


__all__ = ["cuda_available", "interpreting", "kernel_module", "triton_import_error", "unavailable_reason"]
