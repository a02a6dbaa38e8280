"""``attnplug check --json``: the run's machine-readable summary.

A pytest plugin object handed to ``pytest.main`` records every test's outcome with its
backend and case (from the test's parameters); :func:`summary` turns the record into the
JSON object printed on stdout (pytest's own report goes to stderr)::

    {"exit_status": 1, "backends": ["triton"], "counts": {"passed": 70, "failed": 2, "skipped": 8},
     "failed_cases": {"triton": ["scale_one"]},
     "tests": [{"test": "test_outputs_match_reference", "backend": "triton", "case": "scale_one",
                "outcome": "failed", "message": "case 'scale_one' on backend ..."}, ...]}

``message`` is the failure text (or the skip reason; ``""`` for a pass), at most
:data:`MAX_MESSAGE_CHARS` characters. A run refused before pytest starts is ``{"exit_status":
N, "error": "..."}``.
"""

from __future__ import annotations

from typing import Any

MAX_MESSAGE_CHARS = 4000
"""Characters of a failure message kept in the JSON (the rest is cut, ``...`` appended)."""


def _text(report) -> str:
    if report.passed:
        return ""
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2]).removeprefix("Skipped: ")
    else:
        text = report.longreprtext
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


class CheckRecorder:
    """A pytest plugin: per test id, its name, backend, case and outcome."""

    def __init__(self) -> None:
        self.params: dict[str, dict[str, Any]] = {}
        self.tests: dict[str, dict[str, Any]] = {}

    def pytest_itemcollected(self, item) -> None:
        params = getattr(getattr(item, "callspec", None), "params", {})
        case = params.get("conformance_case", params.get("state_case"))
        self.params[item.nodeid] = {
            "test": getattr(item, "originalname", item.name), "backend": params.get("attnplug_backend"),
            "case": getattr(case, "name", None)}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" and not (report.failed or report.skipped):
            return
        entry = self.tests.setdefault(report.nodeid, {**self.params.get(report.nodeid, {"test": report.nodeid}),
                                                      "outcome": "passed", "message": ""})
        if entry["outcome"] == "passed" and not report.passed:   # a failed setup or teardown is a failure
            entry["outcome"], entry["message"] = report.outcome, _text(report)


def summary(recorder: CheckRecorder, backends: list[str], exit_status: int) -> dict[str, Any]:
    """The JSON object of a finished run (module docstring)."""
    tests = list(recorder.tests.values())
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    failed: dict[str, list[str]] = {}
    for t in tests:
        if t["outcome"] == "failed" and t.get("case") and t["case"] not in failed.setdefault(t["backend"], []):
            failed[t["backend"]].append(t["case"])
    return {"exit_status": exit_status, "backends": list(backends), "counts": counts,
            "failed_cases": {b: cases for b, cases in failed.items() if cases}, "tests": tests}


__all__ = ["CheckRecorder", "MAX_MESSAGE_CHARS", "summary"]
