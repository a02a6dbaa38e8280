"""``median_us``: the median wall time of a call, in µs, after warm-up calls.

Standard library only: ``bench/paged_kernel.py`` imports it as part of attnplug, and its vLLM
side ``bench/paged_kernel_vllm.py`` (run by path in vLLM's environment, where attnplug may be
another checkout) imports it from its own directory, so both sides time the same way."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_us(call: Callable[[], object], iters: int, warmup: int) -> float:
    """Run ``call()`` ``warmup`` times untimed, then ``iters`` times (>= 1) each timed with
    ``time.perf_counter``; returns the median in microseconds."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


__all__ = ["median_us"]
