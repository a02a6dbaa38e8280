"""Bad flags and files are refused before any work, in one line with exit status 2; output
into a file or a pipe keeps every number whole (issue 39's rough edges)."""

from __future__ import annotations

import pytest

from attnplug.runner.commands.cli import main as cli


def _one_line_exit_2(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as ei:
        cli(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_run_device_names_the_devices_it_runs_on(capsys):
    err = _one_line_exit_2(capsys, ["run", "--device", "tpu", "--num-requests", "1"])
    assert "--device: 'tpu': attnplug runs on cpu or cuda (cuda:N for one GPU)" in err
    err = _one_line_exit_2(capsys, ["run", "--device", "meta", "--num-requests", "1"])
    assert "--device: 'meta': attnplug runs on cpu or cuda" in err


@pytest.mark.parametrize("value", ["0", "-5"])
def test_backends_explain_refuses_a_block_size_below_1(capsys, value):
    err = _one_line_exit_2(capsys, ["backends", "--explain", "--model", "preset", "--block-size", value])
    assert "--block-size" in err and "must be in [1, 65536]" in err


@pytest.mark.parametrize("path, says", [
    ("/nonexistent/dir/x.png", "no such folder '/nonexistent/dir'"),
    ("{tmp}/x.jpg", "the plot is a PNG image; name the file OUT.png"),
    ("{tmp}", "is a folder; name a file in it"),
])
def test_run_plot_path_is_checked_before_the_run(capsys, monkeypatch, tmp_path, path, says):
    from attnplug.runner.commands import run

    monkeypatch.setattr(run, "_main", lambda args: pytest.fail("the run started"))
    assert cli(["run", "--plot", path.format(tmp=tmp_path), "--num-requests", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_bench_step_sizes_are_bounded(capsys):
    err = _one_line_exit_2(capsys, ["bench", "step", "--sizes", "16,99999999"])
    assert "--sizes" in err and "99999999 is out of range: must be in [1, 4096] (a batch size)" in err
    err = _one_line_exit_2(capsys, ["bench", "step", "--steps", "10000000000"])
    assert "--steps" in err and "must be in [1, 100000]" in err


def test_a_header_only_trace_is_one_line_exit_2(capsys, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert cli(["run", "--trace", str(trace), "--num-requests", "4"]) == 2
    err = capsys.readouterr().err
    assert err == f"attnplug run: {trace}: it has no request rows after the header (line 1), so there is nothing to run\n"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,x,3\n")
    assert cli(["run", "--trace", str(trace), "--skip-invalid"]) == 2
    assert "all 1 request rows were invalid and skipped" in capsys.readouterr().err


def test_tables_into_a_file_or_pipe_keep_every_number_whole(capsys, monkeypatch):
    """rich lays a table out in 80 columns when stdout is not a terminal and cuts cells
    with "…"; the commands' consoles are wide there instead."""
    from attnplug.runner.commands.bench.timing import render_stage_table

    monkeypatch.delenv("COLUMNS", raising=False)
    header = ["workload", "stage", "ours µs", "numpy path µs", "naive µs", "numpy / ours", "naive / ours",
              "target µs"]
    cells = ["steady decode N=1024", "update_states", "12345.6", "23456.7", "34567.8", "1.9×", "2.8×", "100"]
    assert render_stage_table("attnplug bench step — median µs per step", header, [cells], False) == ""
    out = capsys.readouterr().out
    assert "…" not in out and all(c in out for c in cells), out
    row = next(line for line in out.splitlines() if "12345.6" in line)
    assert all(c in row for c in cells[2:]), out   # one line per row: no wrapping either


def test_world_size_mismatch_counts_processes_in_the_singular_too():
    from attnplug.runner.parallel.state import ParallelConfigError, check_sizes

    with pytest.raises(ParallelConfigError, match=r"= 1 process, but WORLD_SIZE is 2"):
        check_sizes(1, 1, 2)
    with pytest.raises(ParallelConfigError, match=r"= 2 processes, but WORLD_SIZE is 1"):
        check_sizes(2, 1, 1)


def test_a_mistyped_model_name_lists_the_presets(capsys):
    """``--model tiny-lama`` said "model config not found: pass 'preset'", naming no preset."""
    from attnplug.runner.commands.run import main as run_main

    assert run_main(["--model", "tiny-lama", "--num-requests", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "model 'tiny-lama' not found: not a preset (tiny-llama, tiny-hybrid" in err and "smollm2" in err, err


@pytest.mark.parametrize("command", ["run", "parity", "serve"])
def test_kv_scales_without_an_fp8_cache_is_refused(capsys, command):
    """``--kv-scales unit`` with the default ``--kv-cache-dtype auto`` ran silently, scales unused."""
    from attnplug.runner.commands.parity import main as parity_main
    from attnplug.runner.commands.run import main as run_main
    from attnplug.runner.commands.serve import main as serve_main

    argv = ["--kv-scales", "unit"] + (["--hf-config", "/nonexistent/config.json", "--num-requests", "1"]
                                      if command == "parity" else ["--model", "tiny-llama"])
    assert {"run": run_main, "parity": parity_main, "serve": serve_main}[command](argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--kv-scales unit: scales apply to an fp8 KV cache only" in err, err
