"""``attnplug bench attention``: time the attention backends on GPU batches from the trace.

For each workload — a **decode** batch (requests mid-generation, one query token each),
a **prefill** batch (whole prompts up to a token budget) and a **mixed** chunked-prefill
step (decodes plus prefill chunks under a budget) — built from the request lengths of the
bundled Azure conversation trace (CC-BY 4.0, Patel et al., ISCA 2024; see
``runner/data/README.md``), every available attention backend (``triton``,
``torch_native``, ``flash_attn``, ``flashinfer``, any plugin; or those named by
``--backend``) runs one layer's ``forward`` through the attnplug contract: its own
builder (built once, not timed), its own KV-cache layout and kernel block size, its own
impl. The time is the median GPU time of ``--iters`` calls after ``--warmup`` calls, each
started from a cold L2 with the host's launch overhead kept out of it (a lead kernel lets
the host queue the whole call first: ``runner/commands/bench/timing.py``); the host's time to queue
one call is reported beside it ("launch ms"). A ``forward`` includes writing the step's
K/V into the cache; the build is not timed.

Reported per (workload, backend): milliseconds, TFLOP/s (``4 * num_heads * head_size`` per
visible query-key pair, causal), GB/s (the least traffic any kernel needs: cached K/V read
once, the step's new K/V read and written to the cache, queries read, outputs written),
and those as fractions of the device's matmul rate (an 8192^3 ``torch.matmul`` in the same
dtype) and copy bandwidth (a 1 GiB ``Tensor.copy_``, read + write bytes), both measured in
the same run and timed the same way. Each backend's output is compared with
``torch_native``'s (``max |Δ|``); a row beyond :data:`TOLERANCE` is marked ``error: wrong
result`` and the command exits 1. Every row also gives its throughput relative to
FlashAttention on the same batch ("vs flash", > 1 is faster): ``flash_attn`` where that
backend ran, else a yardstick row timing PyTorch's bundled FlashAttention-2 kernel on
contiguous K/V (``bench_flash_reference``; ``--no-flash-reference`` drops it).

With ``--markdown`` each workload's rows are printed as soon as they are final, and
``--json`` is rewritten after each workload (``"complete": false`` until the end), so a
run cut off by a timeout keeps what it finished.

On a machine without CUDA, or with ``--device cpu``, the command (its dispatch in
``runner/commands/bench/step.py``) runs the CPU sweep instead (``runner/commands/bench/attention_cpu.py``: µs per call and GB/s over batch x
context x heads x head size, the torch thread count recorded; the Triton interpreter is
not timed, it would measure Python).

The batches and what each backend is given for them are built in
``runner/commands/bench/attention_inputs.py``; the rows, table and JSON are
``runner/commands/bench/attention_report.py``'s.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from attnplug.runner.commands.bench import attention_report as report
from attnplug.runner.commands.bench import flash_reference as flash_ref
from attnplug.runner.commands.bench.attention_inputs import Batch, backend_inputs, dense_kv, step_qkv, trace_batches
from attnplug.runner.commands.bench.attention_report import DevicePeaks, Result
from attnplug.runner.commands.bench.timing import Timing, time_gpu

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
"""Largest difference from ``torch_native``'s output that is not an error, per dtype, for
outputs of magnitude up to 1 and relative beyond (``|Δ| <= tol * max(1, |reference|)``): a
few units in the last place (bf16 keeps 8 bits, fp16 11)."""


def measure_device(dtype: torch.dtype, iters: int = 10) -> DevicePeaks:
    """Copy bandwidth (GB/s, read + write) of a 1 GiB ``copy_`` and the matmul rate (TFLOP/s)
    of an 8192^3 ``torch.matmul`` in ``dtype``: the fastest of ``iters`` calls after two
    warm-up calls (the first starts cuBLAS), timed like the kernels
    (:func:`attnplug.runner.commands.bench.timing.time_gpu`)."""
    n_bytes = 1 << 30
    src = torch.empty(n_bytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_ms = time_gpu(lambda: dst.copy_(src), iters, warmup=2).min_ms
    del src, dst
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    mm_ms = time_gpu(lambda: torch.matmul(a, b), iters, warmup=2).min_ms
    del a, b
    torch.cuda.empty_cache()
    return DevicePeaks(torch.cuda.get_device_name(), 2 * n_bytes / copy_ms / 1e6, 2 * n ** 3 / mm_ms / 1e9,
                       {"copy_ms": round(copy_ms, 3), "matmul_ms": round(mm_ms, 3)})


def candidate_backends(names: list[str] | None):
    """Registered attention backends to time: ``names`` (in order), else all of them."""
    from attnplug.plugins.discovery import get_registry

    reg = get_registry()
    chosen = names or [n for n in reg.names() if reg.get(n).kv_cache_kind == "attention"]
    return [(n, reg.get(n)) for n in chosen]


def time_backend(batch: Batch, backend, args, dtype, kv_dense) -> tuple[Timing, torch.Tensor, int]:
    """The GPU timing of one ``forward``, its output and the block size used."""
    impl, md, kv, q, k, v, bs = backend_inputs(batch, backend, args, dtype, kv_dense)
    out = torch.zeros_like(q)
    timing = time_gpu(lambda: impl.forward(None, q, k, v, kv, md, out), args.iters, args.warmup)
    return timing, out, bs


def time_flash_reference(batch: Batch, args, dtype, kv_dense, peaks: DevicePeaks) -> tuple[Result, torch.Tensor | None]:
    """The FlashAttention yardstick's row (``runner/commands/bench/flash_reference.py``): the same
    q, K/V and softmax scale as the backends, timed like them; a build or device without the
    kernel (or a failure while timing it) gives a ``skipped:`` row, not an error."""
    res = Result(batch.name, flash_ref.NAME, note=flash_ref.NOTE)
    try:
        q, k, v = step_qkv(batch, args, dtype)
        key, value = flash_ref.contiguous_kv(batch.requests, kv_dense, k, v)
        call = flash_ref.flash_reference(batch.requests, q, key, value, args.head_size ** -0.5)
        out = call()
        timing = time_gpu(call, args.iters, args.warmup)
    except (RuntimeError, NotImplementedError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
        res.note = f"skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return res, None
    _set_timing(res, batch, timing, args, dtype, peaks)
    return res, out


def _set_timing(res: Result, batch: Batch, timing: Timing, args, dtype, peaks: DevicePeaks) -> None:
    """``res``'s GPU milliseconds, host launch time, and the rates and fractions of the
    device's peaks they give."""
    res.ms, res.launch_ms = timing.median_ms, timing.launch_ms
    res.tflops, res.gbps = _metrics(batch, res.ms, args, torch.empty((), dtype=dtype).element_size())
    res.frac_matmul, res.frac_copy = res.tflops / peaks.matmul_tflops, res.gbps / peaks.copy_gbps
    if timing.host_bound:
        res.note = "; ".join(x for x in (res.note, "host-bound: ms includes GPU idle time waiting for the host") if x)


def _metrics(batch: Batch, ms: float, args, elem: int) -> tuple[float, float]:
    """TFLOP/s and GB/s of a ``forward`` that took ``ms``; bytes are the least traffic any
    kernel needs: cached K/V (the context) read once, the step's new K/V read from the input
    and written to the cache, queries read, outputs written."""
    flops = 4 * args.num_heads * args.head_size * batch.visible_pairs()
    kv_row = args.num_kv_heads * args.head_size * elem
    q_row = args.num_heads * args.head_size * elem
    bytes_ = 2 * kv_row * batch.context_tokens() + 2 * 2 * kv_row * batch.num_tokens + 2 * q_row * batch.num_tokens
    return flops / ms / 1e9, bytes_ / ms / 1e6


def _check_against_reference(res: Result, out: torch.Tensor | None, reference: torch.Tensor | None, dtype) -> None:
    """``res.max_abs_diff`` against ``torch_native``; a row beyond ``TOLERANCE`` becomes an
    ``error:`` (so the command exits 1): no figure stands for a wrong answer unflagged."""
    if out is None or reference is None:
        return
    diff = (out.float() - reference).abs()
    res.max_abs_diff = float(diff.max())
    if not float((diff / reference.abs().clamp(min=1.0)).max()) <= TOLERANCE[dtype]:  # also catches NaN
        res.note = "; ".join(x for x in (f"error: wrong result, max |Δ| {res.max_abs_diff:.2e} > {TOLERANCE[dtype]:.0e} "
                                         "against torch_native", res.note) if x)


def run(args, on_workload: Callable[[DevicePeaks, list[Result]], None] | None = None
        ) -> tuple[DevicePeaks, list[Result]]:
    """Measure the device's peaks, then time every backend on every workload.

    Args:
        args: the parsed command line (:func:`parser`).
        on_workload: called with the peaks and each workload's finished rows, in order (the
            command prints and saves them as they come).

    Returns:
        The device's peaks and every row, workload by workload.
    """
    dtype = DTYPES[args.dtype]
    peaks = measure_device(dtype)
    from attnplug.core.contracts import AttentionLayerConfig

    results = []
    for batch in trace_batches(args):
        reference = None
        rows = []
        kv_dense = dense_kv(batch, args, dtype)
        for name, backend in candidate_backends(args.backend):
            res = Result(batch.name, name)
            layer = AttentionLayerConfig(args.num_heads, args.num_kv_heads, args.head_size, dtype=dtype,
                                         block_size=args.block_size, device=args.device)
            reasons = backend.validate_configuration(layer)
            bs_ok = backend.get_supported_kernel_block_size(args.block_size) is not None
            reasons = [r for r in reasons if bs_ok or "block_size" not in r]  # the bench adapts the page size
            if reasons:
                res.note = "skipped: " + "; ".join(reasons)
                rows.append((res, None))
                continue
            try:
                timing, out, bs = time_backend(batch, backend, args, dtype, kv_dense)
            except Exception as exc:  # one backend's failure must not hide the others
                res.note = f"error: {type(exc).__name__}: {str(exc)[:200]}"
                rows.append((res, None))
                continue
            res.note = f"page {bs}" if bs != args.block_size else ""
            _set_timing(res, batch, timing, args, dtype, peaks)
            if name == "torch_native":
                reference = out.float()
            rows.append((res, out))
            torch.cuda.empty_cache()
        if args.flash_reference:
            rows.append(time_flash_reference(batch, args, dtype, kv_dense, peaks))
        baseline = next((r for r, _ in rows if r.backend == "flash_attn" and r.ms), None) or \
            next((r for r, _ in rows if r.backend == flash_ref.NAME and r.ms), None)
        for res, out in rows:
            _check_against_reference(res, out, reference, dtype)
            if baseline is not None and res.ms:
                res.vs_flash, res.flash_baseline = baseline.ms / res.ms, baseline.backend
        results.extend(res for res, _ in rows)
        del kv_dense
        torch.cuda.empty_cache()
        if on_workload is not None:
            on_workload(peaks, [res for res, _ in rows])
    return peaks, results


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnplug bench attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", action="append", default=None, metavar="NAME",
                   help="backend to time (repeatable; default: every registered attention backend)")
    p.add_argument("--workload", default="decode,prefill,mixed", help="comma list of decode, prefill, mixed")
    p.add_argument("--decode-batch", type=_csv_ints, default=[64, 256], help="decode batch sizes (default 64,256)")
    p.add_argument("--prefill-tokens", type=int, default=8192, help="tokens of the prefill batch (default 8192)")
    p.add_argument("--mixed-budget", type=int, default=2048, help="tokens of the mixed step (default 2048)")
    p.add_argument("--mixed-decodes", type=int, default=128, help="decode rows in the mixed step (default 128)")
    p.add_argument("--trace", default="conv", help="conv, code or a CSV path (lengths only)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-flash-reference", dest="flash_reference", action="store_false",
                   help="skip the FlashAttention yardstick row (PyTorch's bundled FlashAttention-2 kernel)")
    p.add_argument("--markdown", action="store_true", help="print the markdown table (default: rich table)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write device peaks and results as JSON")
    p.set_defaults(device="cuda")  # the tests drive run() on the CPU with stubbed timers
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.workload = [w.strip() for w in args.workload.split(",") if w.strip()]
    if args.backend:
        args.backend = [n.strip() for item in args.backend for n in item.split(",") if n.strip()]
    if not torch.cuda.is_available():  # `attnplug bench attention` routes a CPU to attention_cpu.py first
        print("attnplug bench attention: the GPU path needs a CUDA device, and torch.cuda.is_available() is False "
              "here; `attnplug bench attention` runs the CPU sweep instead (runner/commands/bench/attention_cpu.py).",
              file=sys.stderr)
        return 2
    done: list[Result] = []

    def on_workload(peaks: DevicePeaks, rows: list[Result]) -> None:
        if args.markdown:  # streamed, so a run cut off by a timeout keeps its finished workloads
            print("\n".join((report.render_header(peaks, args) if not done else []) + report.render_rows(rows)),
                  flush=True)
        done.extend(rows)
        if args.json:
            report.write_json(args.json, peaks, done, args, complete=False)

    peaks, results = run(args, on_workload)
    if args.json:
        report.write_json(args.json, peaks, results, args, complete=True)
    if args.markdown:
        if not results:
            print("\n".join(report.render_header(peaks, args)))
        print("\n".join(report.render_footer(results)), flush=True)
    else:
        from attnplug.runner.commands.report import Console
        from rich.markdown import Markdown

        Console().print(Markdown(report.render(peaks, results, args)))
    return 0 if all(not r.note.startswith("error") for r in results) else 1


__all__ = ["Batch", "DevicePeaks", "Result", "main", "measure_device", "run", "trace_batches"]
