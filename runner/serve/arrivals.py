"""Arrival schedules: when each request of a run arrives, in seconds after the run starts.

The conventions of ``vllm bench serve`` (``vllm/benchmarks/serve.py``, ``get_request``):

* ``--request-rate R`` with ``--burstiness B``: the gaps between arrivals are independent
  Gamma draws of shape ``B`` and scale ``1 / (R * B)``, so their mean is ``1 / R`` and their
  coefficient of variation ``1 / sqrt(B)``. ``B = 1`` is the exponential distribution (a
  Poisson process); ``B < 1`` is burstier, ``B > 1`` more regular, ``B = inf`` a constant
  gap of ``1 / R``. Request ``i`` arrives after the sum of the first ``i + 1`` gaps (the
  first request waits one gap too). vLLM then rescales the arrivals so that the last one
  is at exactly ``N / R`` (N requests), which keeps throughput figures comparable across
  seeds; ``normalize=True`` does the same. ``R = inf`` sends everything at ``t = 0``.
* A trace's own timestamps: request ``i`` arrives at ``(t_i - min(t)) * time_scale``
  (``time_scale < 1`` replays faster).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def _check_positive(name: str, value: float, allow_inf: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 \
        and (allow_inf or math.isfinite(value)) and not math.isnan(value)
    if not ok:
        raise ValueError(f"{name} must be a positive number{' or inf' if allow_inf else ''}, got {value!r}")


def gamma_intervals(n: int, request_rate: float, burstiness: float,
                    rng: np.random.Generator) -> np.ndarray:
    """``n`` inter-arrival gaps (seconds): Gamma(shape ``burstiness``, scale
    ``1 / (request_rate * burstiness)``); ``burstiness = inf``: all ``1 / request_rate``.

    Returns:
        ``[n]`` float64.

    Raises:
        ValueError: ``n < 0``, or a rate / burstiness that is not positive (finite rate).
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    _check_positive("request_rate", request_rate, allow_inf=False)
    _check_positive("burstiness", burstiness)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / request_rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


def rate_arrivals(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0,
                  normalize: bool = True) -> np.ndarray:
    """Arrival times of ``n`` requests at ``request_rate`` per second (module docstring).

    Args:
        n: requests, ``>= 0``.
        request_rate: requests per second, ``> 0``; ``inf``: all at 0.
        burstiness: the Gamma shape, ``> 0`` (``inf``: constant gaps).
        seed: the ``numpy.random.default_rng`` seed of the draws.
        normalize: rescale so that the last arrival is ``n / request_rate`` (vLLM's rule).

    Returns:
        ``[n]`` float64 seconds, non-decreasing.

    Raises:
        ValueError: an argument out of range.
    """
    _check_positive("request_rate", request_rate)
    if math.isinf(request_rate):
        _check_positive("burstiness", burstiness)
        return np.zeros(n)
    times = np.cumsum(gamma_intervals(n, request_rate, burstiness, np.random.default_rng(seed)))
    if normalize and n and times[-1] > 0:
        times *= (n / request_rate) / times[-1]
    return times


def trace_arrivals(timestamps_s: Sequence[float], time_scale: float = 1.0) -> np.ndarray:
    """A trace's arrival times: ``(t_i - min(t)) * time_scale`` (seconds).

    Raises:
        ValueError: a non-finite timestamp, or ``time_scale`` not positive and finite.
    """
    _check_positive("time_scale", time_scale, allow_inf=False)
    t = np.asarray(timestamps_s, dtype=np.float64)
    if t.size == 0:
        return t
    if not np.isfinite(t).all():
        raise ValueError("trace timestamps must be finite")
    return (t - t.min()) * time_scale
