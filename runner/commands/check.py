"""``attnplug check NAME [NAME ...]``: run the conformance suite against backends.

A thin wrapper over ``pytest --pyargs attnplug.plugins.conformance --attnplug-backend
NAME``: it isolates the run from the working directory's pytest configuration (its
``addopts``, ``filterwarnings``...) and makes sure the suite's pytest plugin is loaded
even when attnplug's entry points are not installed. Options after ``--`` go to pytest.

Before pytest starts, the arguments are checked, and a backend that cannot run here is
refused with its reason (``is_available()``'s, or the devices it declares): a run that
would skip every case would pass having tested nothing.

``--json`` prints a machine-readable summary on stdout (``check_report.py``; pytest's
report goes to stderr). A ``package.module:Class`` is also looked up in the working
directory (appended to ``sys.path``: a console script does not put it there).

Exit status: 0 when every case passed or was skipped for a declared limitation and at
least one case ran on each backend; 1 when a case failed; 2 for bad arguments (an unknown
backend, a device this machine lacks such as ``--device cuda`` without CUDA, pytest not
installed); 6 (:data:`EXIT_NOTHING_TESTED`) when a backend cannot run here (unavailable,
or no declared device matches, or not an attention backend) or no case ran on it; other
pytest statuses as pytest defines them (4: a pytest usage error, 5: ``-k`` selected no
test).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import sys
import tempfile

from attnplug.runner.commands.limits import OneLineParser

SUITE = "attnplug.plugins.conformance"
PLUGIN = "attnplug.plugins.conformance.pytest_plugin"
EXIT_USAGE = 2
EXIT_NOTHING_TESTED = 6  # = pytest_plugin.EXIT_NOTHING_TESTED (not imported: it needs pytest)
NO_PYTEST = ("pytest is not installed, and the conformance suite runs under pytest; install the test extra: "
             "pip install 'attnplug[test]' (in a checkout of attnplug: make test)")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="attnplug check", description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog=f"exit status: 0 passed (at least one case ran on each backend); 1 a case failed; {EXIT_USAGE} bad "
               f"arguments (unknown backend, --device this machine lacks, pytest not installed); "
               f"{EXIT_NOTHING_TESTED} nothing tested (a backend unavailable here, or every case skipped); "
               "4, 5: pytest's usage error, no test selected")
    p.add_argument("backends", nargs="+", metavar="NAME",
                   help="registered backend name, package.module:Class, or vllm:NAME (a vLLM backend, docs/vllm.md)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--cases", action="append", default=[], metavar="FILE.json", help="extra cases (repeatable)")
    p.add_argument("--hypothesis", type=int, default=0, metavar="N",
                   help="property mode: only N random cases within the backend's declarations; a failure is "
                        "shrunk and printed as case JSON for --cases (default: 0, off)")
    p.add_argument("-k", dest="keyword", default=None, help="only tests matching this pytest -k expression")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more output (repeatable)")
    p.add_argument("--json", action="store_true",
                   help="print a machine-readable summary on stdout (counts, failed cases, every test's outcome "
                        "and message; runner/commands/check_report.py); pytest's report goes to stderr")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse ``attnplug check`` arguments; everything after ``--`` is kept for pytest."""
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = _parser()
    args = parser.parse_args(argv[:cut])
    if args.hypothesis < 0:
        parser.error(f"--hypothesis N needs N >= 0, got {args.hypothesis}")
    args.pytest_args = list(argv[cut + 1:])
    return args


def _plugin_autoloaded() -> bool:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == PLUGIN for ep in importlib.metadata.entry_points(group="pytest11"))


def pytest_args(args: argparse.Namespace, ini_path: str) -> list[str]:
    """The ``pytest.main`` arguments for parsed ``attnplug check`` options."""
    # the suite's folder, found without importing pytest_plugin: a module imported before
    # pytest loads it (-p) cannot be assert-rewritten (PytestAssertRewriteWarning)
    import importlib.util

    SUITE_DIR = os.path.dirname(os.path.abspath(importlib.util.find_spec(SUITE).origin))

    out = ["-c", ini_path, "--rootdir", str(SUITE_DIR), "-p", "no:cacheprovider",
           "--pyargs", SUITE, "--attnplug-device", args.device, "-rs" if args.verbose else "-q"]  # -v: list skip reasons
    if not _plugin_autoloaded():
        out += ["-p", PLUGIN]
    for name in args.backends:
        out += ["--attnplug-backend", name]
    for path in args.cases:
        out += ["--attnplug-cases", os.path.abspath(path)]
    if args.hypothesis:
        out += ["--attnplug-hypothesis", str(args.hypothesis)]
    if args.keyword or args.hypothesis:
        out += ["-k", args.keyword or "test_property_mode_random_cases"]
    if args.exitfirst:
        out.append("-x")
    out += ["-v"] * args.verbose
    return out + list(args.pytest_args)


def cases_file_problem(path: str) -> str | None:
    """Why ``--cases path`` cannot be used (one line), or ``None``: the file must exist,
    be valid JSON, and be a list of case objects that ``cases.load_cases`` /
    ``state_cases.load_state_cases`` accept (``docs/conformance.md``)."""
    import json

    from attnplug.plugins.conformance.cases import load_cases
    from attnplug.plugins.conformance.state_cases import load_state_cases

    if not os.path.isfile(path):
        return f"--cases {path}: no such file"
    try:
        load_cases(path)
        load_state_cases(path)
    except json.JSONDecodeError as exc:
        return f"--cases {path}: not valid JSON: {exc}"
    except (OSError, UnicodeDecodeError) as exc:
        return f"--cases {path}: cannot read it: {exc}"
    except (ValueError, TypeError, KeyError) as exc:
        return f"--cases {path}: not a valid case list: " + " ".join(str(exc).split())
    return None


def working_directory_on_path(specs: list[str]) -> None:
    """Make ``package.module:Class`` importable from the working directory, as ``python -m
    pytest`` does: a console script puts its own folder on ``sys.path``, not the working
    directory, so a plugin author's ``attnplug check my_pkg.backend:MyBackend`` run from the
    package's folder would fail. The directory is appended, so installed packages win."""
    if any(":" in spec and not spec.startswith("vllm:") for spec in specs):
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.append(cwd)


def preflight(args: argparse.Namespace) -> tuple[int, str] | None:
    """``(exit status, one-line reason)`` when ``attnplug check`` must not run pytest, else ``None``.

    Bad arguments (an unknown or invalid backend, a device this machine lacks, a
    ``--cases`` file that is missing, not JSON or not a case list) give
    :data:`EXIT_USAGE`; a backend that cannot run any case here gives
    :data:`EXIT_NOTHING_TESTED`.
    """
    from attnplug.core.errors import AttnplugError
    from attnplug.plugins.conformance.requirements import device_option_problem, resolve_device, untestable_reason
    from attnplug.plugins.conformance.session import resolve_backend

    why = device_option_problem(args.device, "--device")
    if why:
        return EXIT_USAGE, why
    for path in args.cases:
        why = cases_file_problem(path)
        if why:
            return EXIT_USAGE, why
    backends = {}
    for spec in args.backends:
        try:
            backends[spec] = resolve_backend(spec)
        except AttnplugError as exc:
            return EXIT_USAGE, str(exc)
        except (ImportError, AttributeError, ValueError) as exc:
            where = (f" (looked in the working directory {os.getcwd()} and on sys.path; run from the folder that "
                     "holds the package, or pip install it)" if isinstance(exc, ImportError) else "")
            return EXIT_USAGE, f"cannot import backend {spec!r}: {type(exc).__name__}: {exc}{where}"
    for spec, backend in backends.items():
        why = untestable_reason(backend, resolve_device(backend, args.device))
        if why:
            return EXIT_NOTHING_TESTED, (f"no conformance case can run on backend {spec!r} here, so nothing "
                                         f"would be tested: {why}")
    return None


def main(argv: list[str]) -> int:
    """Run ``attnplug check``; returns the exit status (see the module docstring)."""
    args = parse(argv)
    try:
        import pytest
    except ImportError:
        print(f"attnplug check: {NO_PYTEST}", file=sys.stderr)
        return EXIT_USAGE
    working_directory_on_path(args.backends)
    refused = preflight(args)
    if refused:
        print(f"attnplug check: {refused[1]}", file=sys.stderr)
        if args.json:
            print(json.dumps({"exit_status": refused[0], "error": refused[1]}))
        return refused[0]

    with tempfile.TemporaryDirectory(prefix="attnplug-check-") as tmp:
        ini = os.path.join(tmp, "pytest.ini")
        with open(ini, "w", encoding="utf-8") as f:
            f.write("[pytest]\n")
        if not args.json:
            return int(pytest.main(pytest_args(args, ini)))
        from attnplug.runner.commands.check_report import CheckRecorder, summary

        recorder = CheckRecorder()
        with contextlib.redirect_stdout(sys.stderr):
            status = int(pytest.main(pytest_args(args, ini), plugins=[recorder]))
        print(json.dumps(summary(recorder, args.backends, status), indent=1))
        return status
