"""The hybrid row of ``attnplug bench step`` (48 layers, 6 groups, caching on vs off)."""

from __future__ import annotations

from attnplug.cache_groups.grouping import group_layers_by_spec
from attnplug.runner.commands.bench.step import main as bench_main
from attnplug.runner.commands.bench.metadata import (
    LAYERS_PER_GROUP,
    hybrid_layer_specs,
    hybrid_trace_replay,
    render_hybrid,
    time_hybrid_metadata,
)


def test_hybrid_shape_is_48_layers_in_6_groups_of_3_specs():
    specs = hybrid_layer_specs()
    groups = group_layers_by_spec(specs, max_layers_per_group=LAYERS_PER_GROUP)
    assert len(specs) == 48 and len(groups) == 6
    assert sorted(g.kv_cache_spec.kind for g in groups) == ["full_attention"] * 2 + ["mamba"] * 2 + ["sliding_window"] * 2
    assert len({g.kv_cache_spec for g in groups}) == 3


def test_caching_on_builds_once_per_spec_and_off_builds_every_group():
    hw = hybrid_trace_replay(8, num_requests=12, budget=256, max_model_len=1024, max_num_seqs=8, num_blocks=2000)
    r = time_hybrid_metadata(hw, 6)
    assert (r["builds_on"], r["reuses_on"], r["builds_off"]) == (3, 3, 6)
    assert r["on"] > 0 and r["off"] > 0 and r["steps"] == 6
    table = render_hybrid(hw.workload.name, r, markdown=True)
    assert "48 layers, 6 groups" in table and "3 + 3" in table


def test_bench_cli_can_skip_everything_but_runs(capsys):
    assert bench_main(["--sizes", "", "--trace-steps", "0", "--hybrid-steps", "0", "--no-naive"]) == 0
    assert "CC-BY" not in capsys.readouterr().out, "no trace, no attribution line"


def test_bench_trace_replay_names_the_trace_and_its_licence(capsys):
    assert bench_main(["--sizes", "", "--trace-steps", "3", "--hybrid-steps", "0", "--no-naive", "--repeat", "1",
                       "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "trace replay: request lengths from the bundled trace `conv`" in out and "CC-BY 4.0" in out
