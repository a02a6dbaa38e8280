"""``attnplug bench attention``'s GPU path (the CPU sweep: tests/backends/cpu_sdpa/test_bench_attention_cpu.py); its workloads, metrics
and backend plumbing are exercised here on the CPU (interpreter, stubbed timers: no numbers
are produced), so the GPU run only adds the timings."""

from __future__ import annotations

import pytest
import torch

from attnplug.runner.commands.bench import attention as ba
from attnplug.runner.commands.bench import attention_report as report
from attnplug.runner.commands.bench import flash_reference as flash_ref
from attnplug.runner.commands.bench.timing import Timing
from attnplug.runner.commands.bench.step import main as bench_main

TINY = ["--decode-batch", "3,5", "--prefill-tokens", "40", "--mixed-budget", "24", "--mixed-decodes", "4",
        "--max-model-len", "256", "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "32", "--dtype", "float32",
        "--iters", "1", "--warmup", "0"]


def _fake_timer(ms: float, calls: list | None = None):
    """Stands in for ``time_gpu`` on the CPU: runs the call once, reports ``ms``."""
    def timer(fn, iters, warmup=1):
        if calls is not None:
            calls.append(1)
        fn()
        return Timing((ms,), launch_ms=0.25, lead_ms=0.5, host_bound=False)
    return timer


def _args(*extra):
    args = ba.parser().parse_args([*TINY, *extra])
    args.workload = ["decode", "prefill", "mixed"]
    args.backend = [n for item in (args.backend or []) for n in item.split(",")] or None
    args.device = "cpu"
    return args


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
    assert b.visible_pairs() == 4 + 3 and b.kv_tokens() == 6 and b.context_tokens() == 3
    tflops, gbps = ba._metrics(b, 1.0, args, 4)
    assert tflops == pytest.approx(4 * 4 * 32 * 7 / 1e9)
    kv_row, q_row = 2 * 32 * 4, 4 * 32 * 4
    # cached K/V (3 tokens) read; the 3 new tokens' K/V read and written; q read, out written
    assert gbps == pytest.approx((2 * kv_row * 3 + 2 * 2 * kv_row * 3 + 2 * q_row * 3) / 1e6)


def test_run_times_every_backend_through_the_contract(monkeypatch):
    calls = []
    monkeypatch.setattr(ba, "time_gpu", _fake_timer(1.0, calls))
    monkeypatch.setattr(ba, "measure_device", lambda dtype: ba.DevicePeaks("stub", 100.0, 10.0))
    args = _args("--backend", "triton,torch_native", "--backend", "flash_attn", "--decode-batch", "3")
    peaks, results = ba.run(args)
    by = {(r.workload.split()[0], r.backend): r for r in results}
    assert len(results) == 3 * 4 and len(calls) == 3 * 2
    for workload in ("decode", "prefill", "mixed"):
        tri, ref, fa = by[(workload, "triton")], by[(workload, "torch_native")], by[(workload, "flash_attn")]
        assert tri.ms == 1.0 and tri.max_abs_diff is not None and tri.max_abs_diff < 1e-4, tri
        assert ref.max_abs_diff == 0.0 and tri.frac_copy == pytest.approx(tri.gbps / 100.0)
        assert fa.ms is None and fa.note.startswith("skipped:"), fa
        yardstick = by[(workload, flash_ref.NAME)]  # the CPU build has no FlashAttention kernel
        assert yardstick.ms is None and yardstick.note.startswith("skipped: NotImplementedError"), yardstick
        assert tri.vs_flash is None
    table = report.render(peaks, results, args)
    assert "| decode B=3 | triton | 1.000 | 0.250 |" in table and "CC-BY 4.0" in table and "skipped" in table and "vs flash:" not in table


def _flash_varlen_contract(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           return_debug_mask, *, scale=None):
    """``aten::_flash_attention_forward``'s documented varlen contract, computed densely: packed
    q/k/v, int32 prefix sums, GQA by head groups, causal aligned bottom-right, fp16/bf16 only."""
    assert query.dtype in (torch.float16, torch.bfloat16) and key.dtype == value.dtype == query.dtype
    assert cum_seq_q.dtype == cum_seq_k.dtype == torch.int32 and cum_seq_q.shape == cum_seq_k.shape
    assert dropout_p == 0.0 and is_causal and not return_debug_mask
    q_lens, k_lens = cum_seq_q.diff().tolist(), cum_seq_k.diff().tolist()
    assert max_q == max(q_lens) and max_k == max(k_lens) and cum_seq_k[-1] == key.shape[0]
    group = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    for i, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        q0, k0 = int(cum_seq_q[i]), int(cum_seq_k[i])
        q = query[q0:q0 + nq].float().transpose(0, 1)
        k = key[k0:k0 + nk].float().repeat_interleave(group, 1).transpose(0, 1)
        v = value[k0:k0 + nk].float().repeat_interleave(group, 1).transpose(0, 1)
        visible = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)  # bottom-right
        logits = (q @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
        out[q0:q0 + nq] = (logits.softmax(-1) @ v).transpose(0, 1).to(query.dtype)
    return out, None, None, None, None


def test_flash_yardstick_sets_vs_flash_and_matches_the_reference(monkeypatch):
    monkeypatch.setattr(ba, "time_gpu", _fake_timer(2.0))
    monkeypatch.setattr(ba, "measure_device", lambda dtype: ba.DevicePeaks("stub", 100.0, 10.0))
    monkeypatch.setattr(flash_ref, "_operator", lambda: _flash_varlen_contract)
    # float16: the kernel's dtypes; mixed rows put the new tokens mid-request (c > 0, s > 1)
    args = _args("--backend", "torch_native", "--decode-batch", "3", "--dtype", "float16")
    peaks, results = ba.run(args)
    by = {(r.workload.split()[0], r.backend): r for r in results}
    for workload in ("decode", "prefill", "mixed"):
        ref, yardstick = by[(workload, "torch_native")], by[(workload, flash_ref.NAME)]
        assert yardstick.ms == 2.0 and yardstick.note == flash_ref.NOTE
        assert yardstick.max_abs_diff is not None and yardstick.max_abs_diff < 2e-3, yardstick
        assert ref.vs_flash == pytest.approx(1.0) and ref.flash_baseline == flash_ref.NAME
        assert yardstick.vs_flash == pytest.approx(1.0)
    table = report.render(peaks, results, args)
    assert f"| {flash_ref.NAME} | 2.000 | 0.250 |" in table and f"vs flash: throughput relative to `{flash_ref.NAME}`" in table
    assert not any(r.backend == flash_ref.NAME for r in ba.run(_args("--no-flash-reference", "--decode-batch", "3"))[1])


def test_contiguous_kv_places_the_new_tokens_after_each_context():
    requests = [(2, 1), (0, 3), (1, 2)]
    dense = torch.arange(9.0).view(9, 1, 1)
    new = -torch.arange(1.0, 7.0).view(6, 1, 1)
    key, value = flash_ref.contiguous_kv(requests, (dense, dense + 100), new, new - 100)
    # request 0 = rows 0-2: context 0, 1, then new 0; request 1 = rows 3-5: new 1-3;
    # request 2 = rows 6-8: context 6, then new 4, 5
    assert key.flatten().tolist() == [0, 1, -1, -2, -3, -4, 6, -5, -6]
    assert value.flatten().tolist() == [100, 101, -101, -102, -103, -104, 106, -105, -106]
    assert dense.flatten().tolist() == list(range(9)), "the bench's dense cache is left as it was"


def test_flashinfer_plans_for_the_bench_impl(monkeypatch):
    """flashinfer plans for the impls alive at build time (FA3's scheduler metadata too): the
    bench creates the impl before ``build`` (the emulated wrappers stand in for the kernels)."""
    import gc

    from attnplug.backends.emulators.backends import FlashInferEmulatedBackend

    backend = FlashInferEmulatedBackend
    monkeypatch.setattr(ba, "time_gpu", _fake_timer(1.0))
    gc.collect()  # no impl of an earlier test may stand in for the bench's own
    args = _args("--dtype", "float16", "--decode-batch", "3")
    for batch in ba.trace_batches(args):
        kv_dense = ba.dense_kv(batch, args, torch.float16)
        timing, out, _ = ba.time_backend(batch, backend, args, torch.float16, kv_dense)
        assert timing.median_ms == 1.0 and torch.isfinite(out).all()
        gc.collect()


def test_a_wrong_result_is_an_error_row():
    ref = torch.zeros(4, 2, 8)
    for dtype, off, wrong in ((torch.bfloat16, 2e-2, False), (torch.bfloat16, 5e-2, True),
                              (torch.float16, 5e-3, False), (torch.float16, 2e-2, True), (torch.float32, 1e-2, True)):
        res = ba.Result("decode B=4", "x", note="page 32")
        ba._check_against_reference(res, (ref + off).to(dtype), ref, dtype)
        assert res.max_abs_diff == pytest.approx(off, rel=1e-2)
        assert res.note.startswith("error: wrong result") == wrong and res.note.endswith("page 32"), (dtype, res.note)
    big = torch.full_like(ref, 6.0)  # bf16's last place is 1/32 there: relative beyond magnitude 1
    res = ba.Result("decode B=4", "x")
    ba._check_against_reference(res, (big + 0.03125).to(torch.bfloat16), big, torch.bfloat16)
    assert res.max_abs_diff == pytest.approx(0.03125) and not res.note, res.note
    res = ba.Result("decode B=4", "x")
    ba._check_against_reference(res, torch.full_like(ref, float("nan")), ref, torch.float32)
    assert res.note.startswith("error: wrong result"), "NaN is not within any tolerance"


def _cpu_main(monkeypatch):
    """``main`` on the CPU: CUDA claimed, the CPU as the bench device, timers stubbed."""
    parser = ba.parser

    def cpu_parser():
        p = parser()
        p.set_defaults(device="cpu")
        return p

    monkeypatch.setattr(ba, "parser", cpu_parser)
    monkeypatch.setattr(ba.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ba.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(ba, "measure_device", lambda dtype: ba.DevicePeaks("stub", 100.0, 10.0))


def test_markdown_and_json_are_written_workload_by_workload(monkeypatch, tmp_path, capsys):
    """A run cut off mid-way (the GPU script's section timeout) keeps the finished workloads."""
    import json

    _cpu_main(monkeypatch)
    calls = []
    timer = _fake_timer(1.0, calls)

    def dies_on_the_third_workload(fn, iters, warmup=1):
        if len(calls) == 2:  # decode B=3 and B=5 are done (one backend each)
            raise KeyboardInterrupt  # what a SIGINT/timeout looks like from inside
        return timer(fn, iters, warmup)

    monkeypatch.setattr(ba, "time_gpu", dies_on_the_third_workload)
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        ba.main([*TINY, "--backend", "torch_native", "--no-flash-reference", "--markdown", "--json", str(out)])
    printed = capsys.readouterr().out
    assert printed.count("Device: stub") == 1 and "| decode B=3 | torch_native | 1.000 |" in printed
    assert "| decode B=5 | torch_native |" in printed and "prefill" not in printed
    saved = json.loads(out.read_text())
    assert saved["complete"] is False and [r["workload"] for r in saved["results"]] == ["decode B=3", "decode B=5"]
    assert "CC-BY 4.0" in saved["source"] and "Patel et al." in saved["source"]

    monkeypatch.setattr(ba, "time_gpu", _fake_timer(1.0))
    assert ba.main([*TINY, "--backend", "torch_native", "--no-flash-reference", "--markdown", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("| torch_native |") == 4 and printed.count("Device: stub") == 1
    saved = json.loads(out.read_text())
    assert saved["complete"] is True and len(saved["results"]) == 4
