"""The model-running commands keep freed memory in glibc's heap (runner/commands/heap.py):
a prefill-sized temporary allocated again after a free faults no page in again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnplug.core.errors import ConfigError
from attnplug.runner.commands import cli, heap

pytestmark = pytest.mark.skipif(heap._glibc_mallopt() is None, reason="mallopt is glibc's")

# Eight rounds of a layer's prefill temporaries (8, 8, 8 and 16 MiB live at once: the sizes
# of tiny-llama's 2,048-row products) made, written and freed, as a forward's layers do; then
# the minor page faults of the last four rounds. Python's bytearray takes its memory from
# malloc and zero-fills it.
_ROUNDS = """
import json, resource, sys
from attnplug.runner.commands import heap
kept = heap.keep_freed_memory({"ATTNPLUG_KEEP_HEAP": sys.argv[1]})
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    live = [bytearray(n << 20) for n in (8, 8, 8, 16)]
    del live
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""


def _rounds(switch: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, switch], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_a_freed_temporary_is_reused_without_page_faults():
    on = _rounds("1")
    assert on["kept"] is True
    assert sum(on["faults"][4:]) < 64, on  # 40 MiB is 10,240 pages: none faulted in again


def test_with_the_switch_off_glibc_gives_the_memory_back():
    off = _rounds("0")
    assert off["kept"] is False
    assert sum(off["faults"][4:]) > 4 * 4096, off  # glibc trims the heap: faulted in again each round


def test_a_bad_switch_value_is_refused_before_anything_is_set(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_glibc_mallopt", lambda: lambda *a: calls.append(a) or 1)
    with pytest.raises(ConfigError, match="ATTNPLUG_KEEP_HEAP"):
        heap.keep_freed_memory({"ATTNPLUG_KEEP_HEAP": "yes"})
    assert calls == []
    assert heap.keep_freed_memory({"ATTNPLUG_KEEP_HEAP": "1"}) is True
    assert calls == [(heap.M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD), (heap.M_TRIM_THRESHOLD, heap.TRIM_THRESHOLD),
                     (heap.M_TOP_PAD, heap.TOP_PAD)]


@pytest.mark.parametrize("cmd, applied", [("check", True), ("backends", False)])
def test_only_the_model_running_commands_set_it(monkeypatch, cmd, applied):
    seen = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda *a: seen.append(cmd) or True)
    monkeypatch.setattr(cli.threads, "load_torch_waiting_passively", lambda *a: False)
    try:
        cli.main([cmd, "--help"])  # argparse's help exits 0 after the policy was (or was not) set
    except SystemExit as e:
        assert e.code == 0
    assert seen == ([cmd] if applied else [])
