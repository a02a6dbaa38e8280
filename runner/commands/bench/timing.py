"""GPU time of one call, without the host's launch overhead: the timer of ``attnplug bench``.

Timing ``start.record(); fn(); end.record()`` on an idle GPU measures the host too: the
start event fires at once, and every microsecond Python spends before and between the
call's kernel launches lands between the events. For a decode step whose kernels run for
~50 µs after ~100 µs of Python, that is most of the figure. :func:`time_gpu` therefore
queues a **lead kernel** first (``torch.cuda._sleep``, a spin of a set number of GPU clock
cycles), long enough that the host has queued the whole call before the GPU reaches the
start event: the events then bracket the call's kernels back to back, which is also how
they run when a CUDA graph replays them. The host's own enqueue time is reported beside it
(``launch_ms``): what an eager step pays on the CPU, and what graphs remove.

Before each timed call a 256 MiB buffer is zeroed so that the call starts with a cold L2
cache (the buffer size Triton's ``do_bench`` uses; the H100's L2 is 50 MB, the H200's
60 MB): a kernel is not credited with K/V left in L2 by its previous call.

A call that synchronises with the host inside (``.item()``, ``.cpu()``, ``.tolist()`` of a
GPU tensor) cannot be fully queued ahead: its GPU time then includes the host's gaps after
the synchronisation, and :attr:`Timing.host_bound` says so.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

FLUSH_BYTES = 256 << 20
"""Bytes zeroed before each timed call to evict the L2 cache (Triton ``do_bench``'s size)."""

MIN_LEAD_MS = 0.5
"""The shortest lead kernel; longer when warm-up shows a slower host (3x its enqueue time in
the warm-up calls after the first, which compiles)."""

MAX_LEAD_MS = 100.0
"""The longest lead kernel: a call whose host part takes longer than this is host-bound anyway."""

_cycles_per_ms: dict[int, float] = {}  # per CUDA device index: torch.cuda._sleep's calibration


@dataclass(frozen=True)
class Timing:
    """What :func:`time_gpu` measured, all in milliseconds.

    Attributes:
        samples_ms: GPU time of each timed call (CUDA events around the call only).
        launch_ms: median host time of queueing one call (``time.perf_counter`` around it,
            while the GPU is busy with the lead kernel).
        lead_ms: the lead kernel's length.
        host_bound: True when at least half the timed calls' host part outlasted the lead
            kernel (the call synchronises inside, or its Python is slower than
            ``MAX_LEAD_MS``): then the median includes idle gaps waiting for the host. A
            single late call (another process took the CPU) only lengthens its own sample,
            which neither the median nor the minimum reports, so it does not count.
    """

    samples_ms: tuple[float, ...]
    launch_ms: float
    lead_ms: float
    host_bound: bool

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)


def _flush_buffer() -> torch.Tensor:
    """The L2-evicting buffer (a seam for the CPU tests)."""
    return torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond on the current device.

    The spin counts SM clock cycles, whose rate follows the clock the GPU runs at (an idle
    H200 was seen at 345 MHz, a busy one at 1980 MHz). Measured once per device with CUDA
    events, the fastest of three 10M-cycle spins (the first also raises an idle clock): the
    highest rate gives the shortest real lead, so a lead sized from it is never shorter than
    asked for once the clock is up.
    """
    index = torch.cuda.current_device()
    if index not in _cycles_per_ms:
        torch.cuda._sleep(1_000)  # load the kernel
        cycles, rates = 10_000_000, []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rates.append(cycles / max(start.elapsed_time(end), 1e-3))
        _cycles_per_ms[index] = max(rates)
    return _cycles_per_ms[index]


def time_gpu(fn: Callable[[], object], iters: int, warmup: int = 1, flush_l2: bool = True) -> Timing:
    """The GPU time of ``fn()`` on the current CUDA stream, ``iters`` times.

    Args:
        fn: a call that queues GPU work (its return value is ignored).
        iters: timed calls, >= 1.
        warmup: untimed calls first (compiles, autotuning, allocator growth); at least one is
            always made, since the lead kernel is sized from the host's time in warm-up
            (of the calls after the first, when there are several).
        flush_l2: zero :data:`FLUSH_BYTES` before each timed call (see the module docstring).

    Returns:
        a :class:`Timing`; the bench reports ``median_ms`` for kernels and ``min_ms`` for the
        device's peaks.

    Raises:
        ValueError: ``iters < 1``.
        RuntimeError: no CUDA device (from torch).
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    host = []
    for _ in range(max(warmup, 1)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    settled = host[1:] or host  # the first call compiles, autotunes, allocates: not the steady host time
    lead_ms = min(max(3 * max(settled), MIN_LEAD_MS), MAX_LEAD_MS)
    lead_cycles = int(lead_ms * sleep_cycles_per_ms())
    flush = _flush_buffer() if flush_l2 else None
    samples, launch = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if flush is not None:
            flush.zero_()
        torch.cuda._sleep(lead_cycles)
        start.record()
        t0 = time.perf_counter()
        fn()
        queued_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
        launch.append(queued_ms)
    late = sum(queued >= lead_ms for queued in launch)
    return Timing(tuple(samples), statistics.median(launch), lead_ms, host_bound=2 * late >= len(launch))


__all__ = ["FLUSH_BYTES", "Timing", "sleep_cycles_per_ms", "time_gpu"]


def timed_compile(sc: Any, so: Any) -> tuple[Any, tuple[int, int, int]]:
    """One step through a ``StepCompiler`` ``sc``: ``update_states(so)``,
    ``prepare_inputs(so, build_metadata=False)``, ``build_common_attn_metadata``.

    Returns:
        ``(inputs, (update ns, prepare ns, common metadata ns))`` (``time.perf_counter_ns``).
    """
    clock = time.perf_counter_ns
    t0 = clock()
    sc.update_states(so)
    t1 = clock()
    inputs = sc.prepare_inputs(so, build_metadata=False)
    t2 = clock()
    sc.build_common_attn_metadata(inputs)
    t3 = clock()
    return inputs, (t1 - t0, t2 - t1, t3 - t2)


def render_stage_table(title: str, header: list[str], lines: list[list[str]], markdown: bool) -> str:
    """A per-stage table: markdown text, or printed with ``rich`` (then ``""`` is returned).

    ``lines`` are the cells of each row; a row whose second cell (the stage) is ``"total"``
    ends a section (one workload).
    """
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                         + ["| " + " | ".join(cells) + " |" for cells in lines])
    from attnplug.runner.commands.report import Console
    from rich.table import Table

    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="left" if h in ("workload", "stage") else "right")
    for cells in lines:
        table.add_row(*cells, end_section=cells[1] == "total")
    Console().print(table)
    return ""
