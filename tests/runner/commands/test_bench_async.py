"""`attnplug bench step`'s async table runs, and takes the slice copy exactly when rows
kept their order (no arrivals) and the scatter when condense moved them; it times stage 8
of both protocols."""

from __future__ import annotations

import json

from attnplug.runner.commands.bench.step import main


def test_async_table_in_json(capsys):
    assert main(["step", "--no-compiler", "--hybrid-steps", "0", "--builder-steps", "0", "--sizes", "64",
                 "--async-steps", "6", "--repeat", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["workload"]: r for r in report["async_prepare"]}
    moving, still = rows["steady decode N=64"], rows["steady decode N=64, no arrivals"]
    assert still["slice_steps"] == 6 and still["scatter_steps"] == 0
    assert moving["scatter_steps"] >= 5 and moving["slice_steps"] + moving["scatter_steps"] == 6
    assert all(r["sync_us"] > 0 and r["async_us"] > 0 for r in rows.values())
    assert all(r["stage8_sync_us"] > 0 and r["stage8_async_us"] > 0 for r in rows.values())
    assert report["torch_threads"] == 1
