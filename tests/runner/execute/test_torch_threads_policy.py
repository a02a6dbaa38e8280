"""The commands' torch thread policy (runner/commands/threads.py): precedence of the flag, the
environment variable and OMP_NUM_THREADS; the default's arithmetic (CPUs, local ranks, load);
bad values refused in one line with exit status 2; `bench threads` runs and records each count."""

from __future__ import annotations

import json

import pytest
import torch

from attnplug.runner.commands import threads
from attnplug.runner.commands.cli import main as cli_main


@pytest.mark.parametrize("cpus, ranks, load, want", [
    (2, 1, 0.0, 2),    # idle 2-core machine: both CPUs
    (2, 1, 0.9, 2),    # a fraction of a CPU busy counts as free
    (2, 1, 1.2, 1),    # one CPU busy elsewhere
    (2, 1, 11.0, 1),   # loaded: never below 1
    (16, 4, 0.0, 4),   # torchrun, 4 local ranks: each its share
    (16, 4, 8.5, 2),   # ... of what the others leave free
    (1, 4, 0.0, 1),    # more ranks than CPUs
])
def test_default_is_this_ranks_share_of_the_free_cpus(cpus, ranks, load, want):
    assert threads.default_threads(cpus, ranks, load) == want


def test_flag_beats_variable_beats_omp_beats_default():
    env = {"ATTNPLUG_TORCH_THREADS": "3", "OMP_NUM_THREADS": "5", "LOCAL_WORLD_SIZE": "2"}
    assert threads.resolve("7", env) == (7, "--torch-threads")
    assert threads.resolve(None, env) == (3, "ATTNPLUG_TORCH_THREADS")
    assert threads.resolve(None, {"OMP_NUM_THREADS": "5"}) == (5, "OMP_NUM_THREADS")
    assert threads.resolve(None, {}, default=1) == (1, "default")
    cpus = threads.usable_cpus()
    assert threads.resolve(None, {"LOCAL_WORLD_SIZE": "2"}, load_average=0.0) == (max(1, cpus // 2), "default")
    assert threads.local_ranks({"LOCAL_WORLD_SIZE": "x"}) == 1 and threads.local_ranks({}) == 1


@pytest.mark.parametrize("flag, env, named", [
    ("0", {}, "--torch-threads"),
    ("2.5", {}, "--torch-threads"),
    (None, {"ATTNPLUG_TORCH_THREADS": "-1"}, "ATTNPLUG_TORCH_THREADS"),
    (None, {"ATTNPLUG_TORCH_THREADS": "99999"}, "ATTNPLUG_TORCH_THREADS"),
])
def test_a_bad_value_names_its_flag_or_variable(flag, env, named):
    with pytest.raises(ValueError, match=f"^{named} must be an integer in \\[1, 1024\\]"):
        threads.resolve(flag, env)


@pytest.mark.parametrize("argv", [
    ["run", "--torch-threads", "zero"],
    ["parity", "--model", "smollm2", "--torch-threads", "0"],
    ["bench", "moe", "--torch-threads", "-2"],
])
def test_commands_refuse_a_bad_count_in_one_line_and_change_nothing(argv, capsys):
    before = torch.get_num_threads()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--torch-threads must be an integer" in err
    assert torch.get_num_threads() == before


def test_the_variable_is_refused_by_name(monkeypatch, capsys):
    monkeypatch.setenv("ATTNPLUG_TORCH_THREADS", "many")
    assert cli_main(["bench", "--no-compiler", "--hybrid-steps", "0", "--builder-steps", "0",
                     "--async-steps", "0", "--spec-steps", "0"]) == 2
    assert capsys.readouterr().err.startswith("attnplug bench: ATTNPLUG_TORCH_THREADS must be an integer")


def test_apply_sets_the_count_and_a_bad_one_changes_nothing(monkeypatch, capsys):
    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    monkeypatch.setenv("ATTNPLUG_TORCH_THREADS", str(want))
    try:
        assert threads.apply(None, "attnplug run") is None and torch.get_num_threads() == want
        assert threads.apply("0", "attnplug run") == 2 and torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)
    assert capsys.readouterr().err == "attnplug run: --torch-threads must be an integer in [1, 1024], got '0'\n"


def test_bench_threads_runs_each_count_and_records_it(capsys):
    before = torch.get_num_threads()
    assert cli_main(["bench", "threads", "--counts", "1,2", "--repeat", "1", "--json", "--model", "tiny-llama",
                     "--num-requests", "1", "--max-model-len", "32", "--output-len", "2",
                     "--max-num-seqs", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["count"], r["torch_threads"], r["runs"]) for r in report["rows"]] == [("1", 1, 1), ("2", 2, 1)]
    assert report["outputs_identical"] and report["rows"][0]["wall_ratio_to_first"] == 1.0
    assert torch.get_num_threads() == before


def test_bench_threads_refuses_a_bad_count(capsys):
    assert cli_main(["bench", "threads", "--counts", "1,zero"]) == 2
    assert capsys.readouterr().err.startswith("attnplug bench threads: --counts must be an integer")
