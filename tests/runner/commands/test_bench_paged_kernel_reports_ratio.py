"""``attnplug bench paged-kernel`` (runner/commands/bench/paged_kernel.py): its cases, its figures
and thread count, its errors; and, where a vLLM CPU environment is at hand, the side-by-side
run whose outputs must agree with vLLM's ``cpu_attention_with_kv_cache``."""

from __future__ import annotations

import json
import os

import pytest
import torch

from attnplug.backends.cpu_sdpa import paged
from attnplug.runner.commands.bench import paged_kernel

pytestmark = pytest.mark.skipif(not paged.available(), reason="the compiled paged kernel is not built")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
VLLM_PYTHON = os.environ.get("ATTNPLUG_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "0.32", "bin", "python")


def test_contexts_spread_a_range_evenly_over_the_batch():
    assert paged_kernel.contexts("320", 3) == [320, 320, 320]
    assert paged_kernel.contexts("100-600", 3) == [100, 350, 600]
    assert paged_kernel.contexts("7-9", 1) == [7]


def test_case_is_a_decode_batch_over_a_permuted_block_table():
    case = paged_kernel.make_case((8, 2, 32), [5, 40], 16, 0)
    assert case["query"].shape == (2, 8, 32) and case["kv_cache"].shape == (1 + 3 + 1, 2, 16, 2, 32)
    assert case["seq_lens"].tolist() == [6, 41] and case["query_start_loc"].tolist() == [0, 1, 2]
    used = case["block_table"][0, :1].tolist() + case["block_table"][1, :3].tolist()
    assert sorted(used) == sorted(set(used)) and all(0 <= b < 5 for b in used)


def test_attnplug_alone_prints_figures_and_thread_count(tmp_path, capsys):
    path = tmp_path / "pk.json"
    rc = paged_kernel.main(["--shape", "tiny-llama,4:2:16", "--batch", "2", "--context", "5-40", "--threads", "1",
                            "--rounds", "2", "--iters", "2", "--warmup", "0", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| tiny-llama | 8:2 × 32 | 2 | 5-40 | 1 |" in out and "load average" in out
    report = json.loads(path.read_text())
    assert report["torch_threads"] == [1] and len(report["load_start"]) == 3
    rows = report["rows"]
    assert [r["shape"] for r in rows] == ["tiny-llama", "4:2:16"]
    assert all(r["attnplug_us"] > 0 and r["attnplug_ns_per_pair"] > 0 and r["vllm_us"] is None for r in rows)


@pytest.mark.parametrize("argv", [["--shape", "8:3:32"], ["--context", "9-3"], ["--threads", "0"],
                                  ["--vllm-python", "/nonexistent/python"]])
def test_bad_flags_are_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        paged_kernel.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "error" in err


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason=f"no vLLM CPU environment at {VLLM_PYTHON}")
def test_side_by_side_with_vllm_agrees_on_the_outputs(tmp_path):
    path = tmp_path / "pk.json"
    rc = paged_kernel.main(["--shape", "tiny-llama,smollm2", "--batch", "3", "--context", "20-90", "--threads", "1",
                            "--rounds", "2", "--iters", "2", "--warmup", "0", "--vllm-python", VLLM_PYTHON,
                            "--json", str(path)])
    assert rc == 0
    for row in json.loads(path.read_text())["rows"]:
        assert row["vllm_us"] > 0 and row["ratio"] > 0 and row["vllm_isa"]
        assert row["max_abs_diff"] <= paged_kernel.TOLERANCE
    assert torch.get_num_threads() >= 1
