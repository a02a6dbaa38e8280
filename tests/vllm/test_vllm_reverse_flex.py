"""``attnplug check vllm:FLEX_ATTENTION``: attnplug's conformance suite judges vLLM's
FlexAttention backend through the reverse bridge, its K/V packing read from its own
declaration (``supported_kv_cache_layouts()`` -> ``LBNHC`` -> attnplug's
``("block", "token", "head", "kv", "dim")``, ``plugins/vllm/reverse_layout.py``), in a
subprocess as a user runs it. Every supported minor: on 0.33 (no compiled cache op on this
CPU) the bridge writes K/V by that layout and vLLM's flex attention reads it; on 0.32
vLLM's own ``reshape_and_cache_flash`` writes.

The default test runs the suite's ``prefill_only`` and ``decode_only`` cases (each a
``torch.compile`` of vLLM's flex kernel on the CPU: minutes for the whole catalog, whose
result docs/vllm.md records). The planted-packing test reads FLEX's cache as
``LBHNC`` instead of its declared ``LBNHC``: the check fails (vLLM's FLEX impl cannot even
view a cache laid out so: its flattening of blocks and tokens needs ``LBNHC``'s strides).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

SUBSET = "prefill_only or decode_only"
PLANT = """
import attnplug.plugins.vllm.reverse_layout as R
from attnplug.core.kv_layout import KVCacheLayout
R.declared_layout = lambda vcls: (KVCacheLayout(dims=("block", "head", "token", "kv", "dim")), "LBHNC")
from attnplug.runner.commands.cli import main
raise SystemExit(main())
"""


def _check(*args: str, plant: bool = False) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    head = [sys.executable, "-c", PLANT] if plant else [sys.executable, "-m", "attnplug"]
    proc = subprocess.run([*head, "check", "vllm:FLEX_ATTENTION", *args], env=env, capture_output=True, text=True,
                          timeout=1200)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    return proc, counts


def test_attnplug_check_passes_vllm_flex_attention_with_its_declared_packing(vllm_installed):
    proc, counts = _check("--", "-k", SUBSET)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert counts.get("failed", 0) == 0 and counts.get("error", 0) == 0, counts
    # 2 cases x (outputs, exact KV writes, metadata unmutated, update_block_table, determinism)
    # less what a case does not exercise: 7 passed, 2 skipped on 0.32 and 0.33
    assert counts.get("passed", 0) >= 7, counts


def test_a_wrong_packing_fails_the_check(vllm_installed):
    proc, counts = _check("--", "-k", "decode_only and test_outputs_match_reference", plant=True)
    assert proc.returncode != 0 and counts.get("failed", 0) >= 1, proc.stdout[-3000:]
    # vLLM's FLEX impl views the cache it is handed as its declared LBNHC; the LBHNC strides refuse that view
    assert "view size is not compatible" in proc.stdout or "differ" in proc.stdout, proc.stdout[-3000:]
