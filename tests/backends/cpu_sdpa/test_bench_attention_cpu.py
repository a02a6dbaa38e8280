"""``attnplug bench attention`` on the CPU: the sweep's rows, the thread count, the JSON, and a
wrong backend flagged (exit 1)."""

from __future__ import annotations

import json

import pytest
import torch

from attnplug.backends.cpu_sdpa import paged
from attnplug.backends.cpu_sdpa.impl import CpuSdpaAttentionImpl
from attnplug.runner.commands.bench.step import main as bench_main

TINY = ["attention", "--device", "cpu", "--backend", "torch_native,cpu_sdpa", "--batch", "2", "--prefill-batch", "1",
        "--context", "20", "--heads", "4:2", "--head-size", "16", "--block-size", "4", "--iters", "1", "--warmup", "0"]


def test_cpu_sweep_rows_and_json(tmp_path, capsys):
    path = tmp_path / "b.json"
    assert bench_main([*TINY, "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["torch_threads"] == torch.get_num_threads()
    rows = data["results"]
    assert [(r["workload"], r["backend"]) for r in rows] == [
        (w, b) for w in ("decode", "decode-mixed", "prefill") for b in ("torch_native", "cpu_sdpa")]
    assert all(r["us"] > 0 and r["gbps"] > 0 and r["max_abs_diff"] < 1e-4 and not r["note"] for r in rows)
    assert all(r["vs_native"] == 1.0 for r in rows if r["backend"] == "torch_native")
    out = capsys.readouterr().out
    assert f"torch threads {torch.get_num_threads()}" in out and "| decode-mixed | 2 | 20 | 4:2 | 16 | cpu_sdpa |" in out


def test_wrong_backend_is_flagged(monkeypatch, capsys):
    real = CpuSdpaAttentionImpl._attend_segment
    monkeypatch.setattr(CpuSdpaAttentionImpl, "_attend_segment", lambda self, *a: real(self, *a) * 1.5)
    assert bench_main([*TINY, "--backend", "cpu_sdpa-gather"]) == 1
    out = capsys.readouterr().out
    assert "error: wrong result" in out and "| cpu_sdpa-gather |" in out


def test_wrong_paged_kernel_is_flagged(monkeypatch, capsys):
    if not paged.available():
        pytest.skip("the compiled paged kernel is not built")
    real = paged.paged_attention_checked  # what cpu_sdpa's impl calls after its checks
    monkeypatch.setattr(paged, "paged_attention_checked", lambda *a, **kw: real(*a, **kw).mul_(1.5))
    assert bench_main(TINY) == 1
    assert "error: wrong result" in capsys.readouterr().out


def test_gpu_path_called_without_cuda_points_to_the_sweep(capsys):
    from attnplug.runner.commands.bench import attention

    if torch.cuda.is_available():
        return
    assert attention.main([]) == 2
    assert "runs the CPU sweep instead" in capsys.readouterr().err


def test_bad_flags_are_one_line_errors(capsys):
    for bad in (["--heads", "4:3"], ["--batch", "0"], ["--workload", "decoder"], ["--backend", "nope"],
                ["--context", "64", "--max-model-len", "64"]):
        with pytest.raises(SystemExit) as exc:
            bench_main(["attention", "--device", "cpu", *bad])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, (bad, err)
