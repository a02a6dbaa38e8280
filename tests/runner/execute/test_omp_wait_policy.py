"""The model-running commands load torch with ``OMP_WAIT_POLICY=PASSIVE`` (libgomp reads it
once, at load) on a shared machine (1-minute load average >= 1) unless the user chose a
policy, take the variable out again, and leave libgomp's default on a quiet machine
(runner/commands/threads.py, ``load_torch_waiting_passively``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from attnplug.runner.commands import threads

def _display(policy: str | None, load_average: float = 5.0, busy: float | None = 1.5) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    code = (f"import os, sys\nos.getloadavg = lambda: ({load_average}, 0.0, 0.0)\n"
            f"from attnplug.runner.commands import threads\nthreads.busy_cpus_now = lambda *a: {busy!r}\n"
            "from attnplug.runner.commands import cli\ntry:\n    cli.main(['run', '--help'])\n"
            "except SystemExit:\n    pass\nprint('LEFT', os.environ.get('OMP_WAIT_POLICY'))\n"
            "from attnplug.runner.models import cpu_ops\nprint('MIN_WORK_US', cpu_ops.parallel_min_work_us())")
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def test_run_loads_libgomp_passive_on_a_shared_machine_and_leaves_no_variable_behind():
    out = _display(None, load_average=1.2)
    assert "GOMP_SPINCOUNT = '0'" in out  # passive: no spinning (libgomp's default spins 300000 times)
    assert "LEFT None" in out  # children (vLLM's worker in bench engine) do not inherit it
    assert "MIN_WORK_US 200.0" in out  # the fused ops' threshold for sleeping threads (cpu_ops)


def test_a_load_average_left_by_a_process_that_ended_does_not_count():
    """The 1-minute average still holds a process that ended seconds ago (a benchmark's
    previous round): with under one CPU busy right now, libgomp's default stays."""
    out = _display(None, load_average=1.3, busy=0.2)
    assert "GOMP_SPINCOUNT = '300000'" in out and "MIN_WORK_US 6.0" in out
    out = _display(None, load_average=1.3, busy=None)  # /proc/stat unreadable: the average decides
    assert "GOMP_SPINCOUNT = '0'" in out and "MIN_WORK_US 200.0" in out


def test_busy_cpus_now_sees_a_spinning_process():
    if threads.busy_cpus_now(0.05) is None:
        pytest.skip("no /proc/stat")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.5)
        busy = threads.busy_cpus_now(0.3)
    finally:
        spin.kill()
        spin.wait()
    assert 0.5 <= busy <= (os.cpu_count() or 1) + 0.05


def test_a_quiet_machine_keeps_libgomps_default_spinning():
    out = _display(None, load_average=0.9)
    assert "GOMP_SPINCOUNT = '300000'" in out  # libgomp's default: spin, then sleep
    assert "LEFT None" in out
    assert "MIN_WORK_US 6.0" in out  # the fused ops' threshold for spinning threads


def test_a_passive_policy_the_user_set_gives_the_fused_ops_the_passive_threshold():
    out = _display("PASSIVE", load_average=0.2)
    assert "GOMP_SPINCOUNT = '0'" in out and "LEFT PASSIVE" in out
    assert "MIN_WORK_US 200.0" in out


def test_machine_is_shared_from_one_busy_cpu():
    assert not threads.machine_is_shared(2, 0.99) and threads.machine_is_shared(2, 1.0)
    assert not threads.machine_is_shared(2, -1.0)


def test_a_policy_the_user_set_is_kept():
    before = os.environ.get("OMP_WAIT_POLICY")
    try:
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
        assert threads.load_torch_waiting_passively() is False
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    finally:
        if before is None:
            os.environ.pop("OMP_WAIT_POLICY")
        else:
            os.environ["OMP_WAIT_POLICY"] = before


def test_nothing_is_done_once_torch_is_loaded():
    pytest.importorskip("torch")
    assert threads.load_torch_waiting_passively() is False
    assert "OMP_WAIT_POLICY" not in os.environ or os.environ["OMP_WAIT_POLICY"] != "PASSIVE"
