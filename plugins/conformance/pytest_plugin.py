"""The pytest plugin of the conformance suite (entry point ``pytest11``: ``attnplug``).

Loaded by every pytest run of an environment where attnplug is installed, so it imports
nothing heavy (no torch, no attnplug modules) and does nothing unless
``--attnplug-backend`` is given: it only adds the options and, for the suite's own test
module, the parametrization over backends and cases.

Usage::

    pytest --pyargs attnplug.plugins.conformance --attnplug-backend NAME [--attnplug-backend NAME2]
    attnplug check NAME            # the same, through pytest.main

``NAME`` is a registered backend name or ``package.module:Class``.

A run that tests nothing must not pass: when every case test of a backend was skipped
(it is unavailable here, or its declarations rule every selected case out), the session
exits with :data:`EXIT_NOTHING_TESTED` instead of 0 and says why. A device option this
machine cannot use (``cuda`` without CUDA) is a usage error.
"""

from __future__ import annotations

import importlib
import pathlib

import pytest

SUITE_DIR = pathlib.Path(__file__).resolve().parent
SUITE_PACKAGE = "attnplug.plugins.conformance"
EXIT_NOTHING_TESTED = 6
"""Exit status of a run in which some ``--attnplug-backend`` ran no case (every case test of
it was skipped); pytest's own statuses are 0-5."""
_PROP = "attnplug_backend"


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
    group.addoption("--attnplug-hypothesis", type=int, default=0, metavar="N",
                    help="property mode: also draw N random cases within each backend's declarations "
                         "(needs hypothesis; default: 0, off)")


_SESSION_KEY = pytest.StashKey["object"]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "attnplug_conformance: a test of the attnplug conformance suite")
    if not config.getoption("attnplug_backend"):
        return
    from attnplug.core.errors import AttnplugError
    from attnplug.plugins.conformance.requirements import device_option_problem
    from attnplug.plugins.conformance.session import ConformanceSession

    why = device_option_problem(config.getoption("attnplug_device"))
    if why:
        raise pytest.UsageError(why)
    try:
        session = ConformanceSession(config.getoption("attnplug_backend"), config.getoption("attnplug_device"))
    except (AttnplugError, ImportError, AttributeError) as exc:
        raise pytest.UsageError(f"--attnplug-backend: {exc}") from None
    config.stash[_SESSION_KEY] = session
    config.pluginmanager.register(_CaseTally(), "attnplug-conformance-tally")


class _CaseTally:
    """Counts, per ``--attnplug-backend``, the case tests that ran (passed or failed) and
    those skipped; from the test reports, so it also works under pytest-xdist (the items
    carry their backend in ``user_properties``, which travel with the reports)."""

    def __init__(self) -> None:
        self.ran: dict[str, int] = {}
        self.first_skip: dict[str, str] = {}
        self.failed_run = False

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        params = getattr(getattr(item, "callspec", None), "params", {})
        random = item.name.startswith("test_property_mode_random_cases[")
        if isinstance(params.get("attnplug_backend"), str) and (any(f in params for f in FAMILIES)
                                                               or random or item.name.startswith("test_mla_")):
            item.user_properties.append((_PROP, params["attnplug_backend"]))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        spec = next((v for k, v in report.user_properties if k == _PROP), None)
        if spec is None or (report.when != "call" and not report.skipped and not report.failed):
            return
        self.ran.setdefault(spec, 0)
        if not report.skipped:
            self.ran[spec] += 1
        elif spec not in self.first_skip:
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
            self.first_skip[spec] = reason.removeprefix("Skipped: ")

    def untested(self) -> list[str]:
        return [spec for spec, n in self.ran.items() if n == 0]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput"):  # an xdist worker: the controller decides
            return
        if session.exitstatus == pytest.ExitCode.OK and self.untested():
            session.exitstatus = EXIT_NOTHING_TESTED
            self.failed_run = True

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.failed_run:
            return
        for spec in self.untested():
            terminalreporter.write_line(
                f"attnplug conformance: no case ran on backend {spec!r}, so nothing was tested (exit status "
                f"{EXIT_NOTHING_TESTED}); every case was skipped, e.g. {self.first_skip.get(spec, '')}", red=True)


class _SuiteModule(pytest.Module):
    """Imports the suite's test modules under their package name (``attnplug.plugins.
    conformance.test_*``) whatever the rootdir and import mode are."""

    def _getobj(self):
        return importlib.import_module(f"{SUITE_PACKAGE}.{self.path.stem}")


def pytest_pycollect_makemodule(module_path: pathlib.Path, parent):
    if module_path.parent == SUITE_DIR and module_path.name.startswith("test_"):
        return _SuiteModule.from_parent(parent, path=module_path)
    return None


FAMILY_OF_KIND = {"attention": "conformance_case", "mamba": "state_case", "mla": "mla_case",
                  "indexer": "selector_case", "sparse_mla": "sparse_mla_case"}
"""The case family a backend of each ``kv_cache_kind`` runs; the other family's tests are
not collected for it (they could only skip). A backend of another kind gets both, which
skip with the reason, so the run reports that nothing was tested. A sparse MLA backend
(``sparse = True``, ``core/sparse.py``) runs the ``sparse_mla`` family (:func:`family_key`)."""

FAMILIES = ("conformance_case", "state_case", "mla_case", "selector_case", "sparse_mla_case")


def family_key(backend) -> str:
    """The :data:`FAMILY_OF_KIND` key of a backend: its ``kv_cache_kind``, ``"sparse_mla"``
    for a sparse MLA backend."""
    return "sparse_mla" if getattr(backend, "sparse", False) else backend.kv_cache_kind


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.fixturenames
    family = next((f for f in FAMILIES if f in names), None)
    cases, ids = _cases(metafunc, family) if family else ([], [])
    if "attnplug_backend" in names:
        specs = metafunc.config.getoption("attnplug_backend")
        session = metafunc.config.stash.get(_SESSION_KEY, None)
        if specs and family and session is not None:
            kinds = {spec: family_key(session.backends[spec]) for spec in specs}
            pairs = [(spec, case) for spec in specs for case in cases
                     if FAMILY_OF_KIND.get(kinds[spec], family) == family]
            metafunc.parametrize(("attnplug_backend", family), pairs,
                                 ids=[f"{spec}-{case.name}" for spec, case in pairs])
            return
        if specs:
            metafunc.parametrize("attnplug_backend", specs, ids=specs, scope="session")
        else:
            metafunc.parametrize("attnplug_backend", [pytest.param(None, marks=pytest.mark.skip(
                reason="no --attnplug-backend NAME given: the conformance suite runs only against a named "
                       "backend (e.g. `attnplug check torch_native`)"))], ids=["no-backend"])
    if family:
        metafunc.parametrize(family, cases, ids=ids)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop the placeholder pytest makes for a case test no ``--attnplug-backend`` runs
    (every backend serves the other family: an empty parameter set, not a skip)."""
    if config.stash.get(_SESSION_KEY, None) is None:
        return
    items[:] = [item for item in items
                if not (item.path.parent == SUITE_DIR and any(str(m.kwargs.get("reason", "")).startswith(
                    "got empty parameter set") for m in item.iter_markers("skip")))]


def _cases(metafunc: pytest.Metafunc, family: str) -> tuple[list, list[str]]:
    """The catalog of ``family`` plus ``--attnplug-cases``, filtered by the test's
    ``_attnplug_case_filter``; and their ids."""
    paths = metafunc.config.getoption("attnplug_cases")
    if family == "conformance_case":
        from attnplug.plugins.conformance.cases import CASES, load_cases

        cases = list(CASES) + [c for path in paths for c in load_cases(path)]
        only = getattr(metafunc.function, "_attnplug_case_filter", None)
        if only is not None:
            cases = [c for c in cases if only(c)]
    elif family == "mla_case":
        from attnplug.plugins.conformance.mla_cases import MLA_CASES

        cases = list(MLA_CASES)
    elif family == "selector_case":
        from attnplug.plugins.conformance.sparse_cases import SELECTOR_CASES

        cases = list(SELECTOR_CASES)
    elif family == "sparse_mla_case":
        from attnplug.plugins.conformance.sparse_cases import SPARSE_MLA_CASES

        cases = list(SPARSE_MLA_CASES)
    else:
        from attnplug.plugins.conformance.state_cases import STATE_CASES, load_state_cases

        cases = list(STATE_CASES) + [c for path in paths for c in load_state_cases(path)]
    return cases, [c.name for c in cases]


@pytest.fixture(scope="session")
def attnplug_conformance(request: pytest.FixtureRequest):
    """The session's :class:`~attnplug.plugins.conformance.session.ConformanceSession`."""
    session = request.config.stash.get(_SESSION_KEY, None)
    if session is None:
        pytest.skip("no --attnplug-backend given")
    return session
