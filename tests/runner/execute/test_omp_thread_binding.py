"""``ATTNPLUG_OMP_BIND=1`` pins torch's OpenMP threads one per CPU (runner/commands/threads.py,
through runner/models/cpu_ops.bind_threads); a bad value is one line and exit status 2."""

from __future__ import annotations

import os

import pytest
import torch

from attnplug.runner.commands import threads
from attnplug.runner.commands.cli import main as cli_main
from attnplug.runner.models import cpu_ops


def test_binding_asked_reads_0_1_and_refuses_the_rest():
    assert threads.binding_asked({}) is False
    assert threads.binding_asked({"ATTNPLUG_OMP_BIND": "0"}) is False
    assert threads.binding_asked({"ATTNPLUG_OMP_BIND": "1"}) is True
    with pytest.raises(ValueError, match="ATTNPLUG_OMP_BIND must be 0 or 1, got 'yes'"):
        threads.binding_asked({"ATTNPLUG_OMP_BIND": "yes"})


def test_bind_plan_is_one_cpu_per_thread_in_order():
    assert threads.bind_plan(2, [5, 3]) == [[3], [5]]
    assert threads.bind_plan(3, [0, 1]) == [[0], [1], [0]]


def test_bad_bind_value_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("ATTNPLUG_OMP_BIND", "yes")
    assert cli_main(["bench", "engine", "--vllm-python", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["attnplug bench engine: ATTNPLUG_OMP_BIND must be 0 or 1, got 'yes'"]


def _threads_allowed_lists() -> list[str]:
    out = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status", encoding="ascii") as f:
            out += [line.rstrip("\n") for line in f if line.startswith("Cpus_allowed_list:")]
    return out


@pytest.mark.skipif(not cpu_ops.available(), reason="runner/models/_cpu_ops is not built")
def test_each_omp_thread_runs_on_its_cpu_after_binding():
    cpus = sorted(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cpu_ops.bind_threads([[cpus[0]], [cpus[-1]]])
        assert os.sched_getaffinity(0) == {cpus[0]}  # thread 0 of the team is this thread
        if len(cpus) > 1:  # the team's other thread, pinned to the last CPU
            assert f"Cpus_allowed_list:\t{cpus[-1]}" in _threads_allowed_lists()
        cpu_ops.bind_threads([cpus, cpus])  # unpinned again
        assert os.sched_getaffinity(0) == set(cpus)
        with pytest.raises(ValueError, match="non-empty"):
            cpu_ops.bind_threads([[cpus[0]], []])
    finally:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(before)
