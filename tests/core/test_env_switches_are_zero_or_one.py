"""Every ``ATTNPLUG_*`` on/off switch (core/switches.py) is read one way: ``1`` on, ``0`` off,
unset or empty its default; any other value is refused naming the variable — by the library
where the switch is read, and by the command line in one line with exit status 2 before the
command runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attnplug.core import switches
from attnplug.core.errors import ConfigError


@pytest.mark.parametrize("name", sorted(switches.SWITCHES))
def test_one_zero_unset_and_empty(name):
    default = switches.SWITCHES[name]
    assert switches.flag(name, {}) is default
    assert switches.flag(name, {name: ""}) is default
    assert switches.flag(name, {name: "1"}) is True
    assert switches.flag(name, {name: " 0\n"}) is False


@pytest.mark.parametrize("value", ["off", "on", "true", "yes", "2", "00", "-1", "1.0"])
def test_other_values_are_refused_naming_the_variable(value):
    with pytest.raises(ConfigError, match=rf"^env ATTNPLUG_CPU_PAGED_KERNEL: '{value}' is not a switch value"):
        switches.flag("ATTNPLUG_CPU_PAGED_KERNEL", {"ATTNPLUG_CPU_PAGED_KERNEL": value})
    with pytest.raises(ConfigError, match="env ATTNPLUG_VALIDATE"):
        switches.check_environment({"ATTNPLUG_NATIVE": "1", "ATTNPLUG_VALIDATE": value})


def test_the_read_sites_refuse_a_bad_value_instead_of_guessing(monkeypatch):
    from attnplug.backends.cpu_sdpa import paged
    from attnplug.runner.models import cpu_ops
    from attnplug.runner.step.compiler import StepCompiler

    monkeypatch.setenv("ATTNPLUG_CPU_PAGED_KERNEL", "0")
    import torch
    assert "turned off" in (paged.unsupported(torch.float32, torch.float32, 32) or "")
    monkeypatch.setenv("ATTNPLUG_CPU_PAGED_KERNEL", "off")  # used to mean "on" (anything but "0")
    with pytest.raises(ConfigError, match="ATTNPLUG_CPU_PAGED_KERNEL"):
        paged.unsupported(torch.float32, torch.float32, 32)
    monkeypatch.setenv("ATTNPLUG_CPU_FUSED_OPS", "false")
    with pytest.raises(ConfigError, match="ATTNPLUG_CPU_FUSED_OPS"):
        cpu_ops.enabled()
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "yes")  # used to mean "off" in the step compiler, "on" under TP
    with pytest.raises(ConfigError, match="ATTNPLUG_VALIDATE"):
        StepCompiler([4], max_num_reqs=2, max_model_len=8, max_num_batched_tokens=8, num_blocks=8)


def test_the_command_line_says_one_line_and_exits_2(monkeypatch):
    env = {"ATTNPLUG_CPU_FUSED_OPS": "off", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "attnplug", "backends"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == ["attnplug backends: env ATTNPLUG_CPU_FUSED_OPS: 'off' is not a switch value: "
                                        "1 (on), 0 (off) or unset (default on)"]
