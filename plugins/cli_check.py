"""``attnplug check NAME [NAME ...]``: run the conformance suite against backends.

A thin wrapper over ``pytest --pyargs attnplug.plugins.conformance --attnplug-backend
NAME``: it isolates the run from the working directory's pytest configuration (its
``addopts``, ``filterwarnings``...) and makes sure the suite's pytest plugin is loaded
even when attnplug's entry points are not installed. Options after ``--`` go to pytest.

Exit status: pytest's (0: every case passed or was skipped for a declared limitation).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import tempfile

SUITE = "attnplug.plugins.conformance"
PLUGIN = "attnplug.plugins.conformance.pytest_plugin"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnplug check", description=__doc__.split("\n\n")[0])
    p.add_argument("backends", nargs="+", metavar="NAME",
                   help="registered backend name, or package.module:Class")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:1 ...")
    p.add_argument("--cases", action="append", default=[], metavar="FILE.json", help="extra cases (repeatable)")
    p.add_argument("-k", dest="keyword", default=None, help="only tests matching this pytest -k expression")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more output (repeatable)")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse ``attnplug check`` arguments; everything after ``--`` is kept for pytest."""
    cut = argv.index("--") if "--" in argv else len(argv)
    args = _parser().parse_args(argv[:cut])
    args.pytest_args = list(argv[cut + 1:])
    return args


def _plugin_autoloaded() -> bool:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == PLUGIN for ep in importlib.metadata.entry_points(group="pytest11"))


def pytest_args(args: argparse.Namespace, ini_path: str) -> list[str]:
    """The ``pytest.main`` arguments for parsed ``attnplug check`` options."""
    from attnplug.plugins.conformance.pytest_plugin import SUITE_DIR

    out = ["-c", ini_path, "--rootdir", str(SUITE_DIR), "-p", "no:cacheprovider",
           "--pyargs", SUITE, "--attnplug-device", args.device, "-rs" if args.verbose else "-q"]  # -v: list skip reasons
    if not _plugin_autoloaded():
        out += ["-p", PLUGIN]
    for name in args.backends:
        out += ["--attnplug-backend", name]
    for path in args.cases:
        out += ["--attnplug-cases", os.path.abspath(path)]
    if args.keyword:
        out += ["-k", args.keyword]
    if args.exitfirst:
        out.append("-x")
    out += ["-v"] * args.verbose
    return out + list(args.pytest_args)


def main(argv: list[str]) -> int:
    args = parse(argv)
    import pytest

    with tempfile.TemporaryDirectory(prefix="attnplug-check-") as tmp:
        ini = os.path.join(tmp, "pytest.ini")
        with open(ini, "w", encoding="utf-8") as f:
            f.write("[pytest]\n")
        return int(pytest.main(pytest_args(args, ini)))
