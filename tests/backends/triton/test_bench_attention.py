"""``attnplug bench attention``: refuses the CPU with a clear message; its workloads, metrics
and backend plumbing are exercised here on the CPU (interpreter, stubbed timers: no numbers
are produced), so the GPU run only adds the timings."""

from __future__ import annotations

import pytest

from attnplug.runner import bench_attention as ba
from attnplug.runner.bench import main as bench_main

TINY = ["--decode-batch", "3,5", "--prefill-tokens", "40", "--mixed-budget", "24", "--mixed-decodes", "4",
        "--max-model-len", "256", "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "32", "--dtype", "float32",
        "--iters", "1", "--warmup", "0"]


def _args(*extra):
    args = ba.parser().parse_args([*TINY, *extra])
    args.workload = ["decode", "prefill", "mixed"]
    args.backend = [n for item in (args.backend or []) for n in item.split(",")] or None
    args.device = "cpu"
    return args


def test_cpu_run_says_it_needs_cuda(capsys):
    assert bench_main(["attention"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err and "torch.cuda.is_available() is False" in err


def test_trace_batches_shapes():
    decode3, decode5, prefill, mixed = ba.trace_batches(_args())
    assert [s for _, s in decode3.requests] == [1, 1, 1] and len(decode5.requests) == 5
    assert all(c > 0 for c, _ in decode5.requests)
    assert prefill.num_tokens == 40 and all(c == 0 for c, _ in prefill.requests)
    assert mixed.num_tokens == 24 and [s for _, s in mixed.requests[:4]] == [1, 1, 1, 1], "decodes first"
    assert mixed.requests[4][0] > 0, "the first prefill chunk continues a prompt"
    assert all(c + s <= 255 for c, s in decode5.requests + prefill.requests + mixed.requests)


def test_metrics_formulas():
    args = _args()
    b = ba.Batch("x", [(3, 1), (0, 2)])
    assert b.visible_pairs() == 4 + 3 and b.kv_tokens() == 6
    tflops, gbps = ba._metrics(b, 1.0, args, 4)
    assert tflops == pytest.approx(4 * 4 * 32 * 7 / 1e9)
    kv_row, q_row = 2 * 32 * 4, 4 * 32 * 4
    assert gbps == pytest.approx((2 * kv_row * 6 + 2 * q_row * 3 + 4 * kv_row * 3) / 1e6)


def test_run_times_every_backend_through_the_contract(monkeypatch):
    calls = []

    def fake_timer(fn, iters, warmup):
        calls.append(1)
        fn()
        return 1.0

    monkeypatch.setattr(ba, "_cuda_time_ms", fake_timer)
    monkeypatch.setattr(ba, "measure_device", lambda dtype: ba.DevicePeaks("stub", 100.0, 10.0))
    args = _args("--backend", "triton,torch_native", "--backend", "flash_attn", "--decode-batch", "3")
    peaks, results = ba.run(args)
    by = {(r.workload.split()[0], r.backend): r for r in results}
    assert len(results) == 3 * 3 and len(calls) == 3 * 2
    for workload in ("decode", "prefill", "mixed"):
        tri, ref, fa = by[(workload, "triton")], by[(workload, "torch_native")], by[(workload, "flash_attn")]
        assert tri.ms == 1.0 and tri.max_abs_diff is not None and tri.max_abs_diff < 1e-4, tri
        assert ref.max_abs_diff == 0.0 and tri.frac_copy == pytest.approx(tri.gbps / 100.0)
        assert fa.ms is None and fa.note.startswith("skipped:"), fa
    table = ba.render(peaks, results, args)
    assert "| decode B=3 | triton | 1.000 |" in table and "skipped" in table
