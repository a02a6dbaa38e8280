"""`attnplug bench step`'s builders tables: flags are validated, and a tiny run reports
every backend's build / update_block_table and the two full-step layouts (as JSON too)."""

from __future__ import annotations

import json

import pytest

from attnplug.runner.commands.bench.builders import BACKENDS, run_builders, time_builders
from attnplug.runner.commands.bench.step import main as bench_main
from attnplug.runner.commands.bench.workloads import steady_decode

SKIP_REST = ["--trace-steps", "0", "--hybrid-steps", "0", "--no-naive", "--no-compiler", "--repeat", "1"]


@pytest.mark.parametrize("argv, needle", [
    (["--sizes", "abc"], "expected an integer in [1, 4096] (a batch size), got 'abc'"),
    (["--sizes", "-4"], "-4 is out of range: must be in [1, 4096] (a batch size)"),
    (["--steps", "0"], "0 is out of range: must be in [1, 100000]"),
    (["--repeat", "0"], "0 is out of range: must be in [1, 100000]"),
    (["--builder-steps", "x"], "expected an integer in [0, 100000], got 'x'"),
])
def test_bad_flags_are_a_one_line_usage_error(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("attnplug bench: error:") and needle in err[-1]


def test_every_backend_builds_and_the_shared_ones_update():
    w = steady_decode(4, 3)
    for backend in BACKENDS:
        r = time_builders(w, 3, backend)
        assert r["build"] > 0, backend
        assert ("update_block_table" in r) == (backend not in ("flashinfer", "mla")), backend
    rows = run_builders([4], 2, 0, repeat=2, backends=("triton",))
    assert {(r["backend"], r["op"]) for r in rows} == {("triton", "build"), ("triton", "update_block_table")}
    assert all(r["min"] <= r["median"] <= r["max"] for r in rows)


def test_json_has_every_figure_threads_and_load(capsys):
    assert bench_main(["--sizes", "4", "--builder-steps", "2", "--json", *SKIP_REST]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch_threads"] == 1 and len(report["load_average"]) == 3
    assert {r["backend"] for r in report["builders"]} == set(BACKENDS)
    layouts = {(r["layout"], r["groups"], r["attention"]) for r in report["full_step"]}
    assert layouts == {(l, g, a) for l, g in (("tiny-hybrid", 3), ("hybrid-48", 6)) for a in ("triton", "torch_native")}
    assert all(r["min"] <= r["median"] <= r["max"] for r in report["builders"] + report["full_step"])


def test_markdown_tables_name_the_targets(capsys):
    assert bench_main(["--sizes", "4", "--builder-steps", "2", "--markdown", *SKIP_REST]) == 0
    out = capsys.readouterr().out
    assert "| workload | backend | op |" in out and "| workload | groups | attention |" in out
    assert "torch threads: 1" in out
