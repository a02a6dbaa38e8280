"""The pytest plugin of the conformance suite (entry point ``pytest11``: ``attnplug``).

Loaded by every pytest run of an environment where attnplug is installed, so it imports
nothing heavy (no torch, no attnplug modules) and does nothing unless
``--attnplug-backend`` is given: it only adds the options and, for the suite's own test
module, the parametrization over backends and cases.

Usage::

    pytest --pyargs attnplug.plugins.conformance --attnplug-backend NAME [--attnplug-backend NAME2]
    attnplug check NAME            # the same, through pytest.main

``NAME`` is a registered backend name or ``package.module:Class``.
"""

from __future__ import annotations

import importlib
import pathlib

import pytest

SUITE_DIR = pathlib.Path(__file__).resolve().parent
SUITE_PACKAGE = "attnplug.plugins.conformance"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnplug", "attnplug backend conformance suite")
    group.addoption("--attnplug-backend", action="append", default=[], metavar="NAME",
                    help="run the attnplug conformance suite against this backend (registered name or "
                         "module:Class); repeatable")
    group.addoption("--attnplug-device", default="auto", metavar="DEVICE",
                    help="device for the conformance suite: auto (cuda when available and declared), cpu, "
                         "cuda, cuda:1 ... (default: auto)")
    group.addoption("--attnplug-cases", action="append", default=[], metavar="FILE.json",
                    help="extra conformance cases: a JSON list of case objects (repeatable)")


_SESSION_KEY = pytest.StashKey["object"]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "attnplug_conformance: a test of the attnplug conformance suite")
    if not config.getoption("attnplug_backend"):
        return
    from attnplug.core.errors import AttnplugError
    from attnplug.plugins.conformance.session import ConformanceSession

    try:
        session = ConformanceSession(config.getoption("attnplug_backend"), config.getoption("attnplug_device"))
    except (AttnplugError, ImportError, AttributeError) as exc:
        raise pytest.UsageError(f"--attnplug-backend: {exc}") from None
    config.stash[_SESSION_KEY] = session


class _SuiteModule(pytest.Module):
    """Imports the suite's test modules under their package name (``attnplug.plugins.
    conformance.test_*``) whatever the rootdir and import mode are."""

    def _getobj(self):
        return importlib.import_module(f"{SUITE_PACKAGE}.{self.path.stem}")


def pytest_pycollect_makemodule(module_path: pathlib.Path, parent):
    if module_path.parent == SUITE_DIR and module_path.name.startswith("test_"):
        return _SuiteModule.from_parent(parent, path=module_path)
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.fixturenames
    if "attnplug_backend" in names:
        specs = metafunc.config.getoption("attnplug_backend")
        if specs:
            metafunc.parametrize("attnplug_backend", specs, ids=specs, scope="session")
        else:
            metafunc.parametrize("attnplug_backend", [pytest.param(None, marks=pytest.mark.skip(
                reason="no --attnplug-backend NAME given: the conformance suite runs only against a named "
                       "backend (e.g. `attnplug check torch_native`)"))], ids=["no-backend"])
    if "conformance_case" in names:
        from attnplug.plugins.conformance.cases import CASES, load_cases

        cases = list(CASES)
        for path in metafunc.config.getoption("attnplug_cases"):
            cases += load_cases(path)
        only = getattr(metafunc.function, "_attnplug_case_filter", None)
        if only is not None:
            cases = [c for c in cases if only(c)]
        metafunc.parametrize("conformance_case", cases, ids=[c.name for c in cases])


@pytest.fixture(scope="session")
def attnplug_conformance(request: pytest.FixtureRequest):
    """The session's :class:`~attnplug.plugins.conformance.session.ConformanceSession`."""
    session = request.config.stash.get(_SESSION_KEY, None)
    if session is None:
        pytest.skip("no --attnplug-backend given")
    return session
