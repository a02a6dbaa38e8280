"""``attnplug bench attention`` on CUDA: the timer keeps host time out, and a small bench
runs end to end with every row correct (the full-size table is ``run_all.sh``'s)."""

from __future__ import annotations

import json
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")]


def test_time_gpu_measures_the_kernels_not_the_host():
    from attnplug.runner.commands.bench.timing import sleep_cycles_per_ms, time_gpu

    kernel_cycles = int(0.2 * sleep_cycles_per_ms())  # a 0.2 ms kernel

    def call():
        time.sleep(0.003)  # 3 ms of host work before the launch
        torch.cuda._sleep(kernel_cycles)

    timing = time_gpu(call, iters=10, warmup=2)
    assert not timing.host_bound and timing.launch_ms >= 3.0, timing
    # the fastest call: other xdist workers share the GPU and can delay single calls
    assert 0.1 < timing.min_ms < 1.0, f"the 3 ms of host work leaked into the GPU time: {timing}"

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    call()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) > 3.0, "events around an idle GPU's call do include the host (what time_gpu avoids)"


def test_small_bench_runs_every_row_correct(tmp_path):
    from attnplug.runner.commands.bench.attention import main

    out = tmp_path / "bench.json"
    rc = main(["--backend", "triton,torch_native", "--decode-batch", "4", "--prefill-tokens", "512",
               "--mixed-budget", "256", "--mixed-decodes", "8", "--max-model-len", "2048", "--iters", "3",
               "--markdown", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert rc == 0 and saved["complete"], saved
    rows = {(r["workload"].split()[0], r["backend"]): r for r in saved["results"]}
    for workload in ("decode", "prefill", "mixed"):
        triton = rows[(workload, "triton")]
        assert triton["ms"] > 0 and triton["launch_ms"] > 0 and triton["max_abs_diff"] < 3e-2, triton
        assert triton["vs_flash"] is not None, "the FlashAttention yardstick ran"
