"""Arrival generators: Gamma gaps of shape B and mean 1/R (B = 1: exponential, a Poisson
process), checked for their mean, coefficient of variation and whole distribution on fixed
seeds; vLLM's rescaling of the last arrival to N / R; trace timestamps scaled.

Tolerances. With n = 20,000 gaps the sample mean's standard error is
``(1/R) / sqrt(B * n)`` (< 1 % of the mean for B >= 0.5): we allow 4 standard errors
(a 6e-5 chance of a false failure had the seed not been fixed). The coefficient of variation
(1/sqrt(B)) gets 5 %: its standard error is below 1.5 % for these shapes. The
Kolmogorov-Smirnov distance to the Gamma CDF (``torch.special.gammainc``) must stay below
1.95 / sqrt(n) = 0.0138, the 0.1 % critical value; a wrong shape (exponential gaps of the
right mean drawn for B = 0.5 or 4) is at a distance of 0.16 and 0.26, over ten times that.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnplug.runner.serve.arrivals import gamma_intervals, rate_arrivals, trace_arrivals

N = 20_000


def ks_distance_to_gamma(x: np.ndarray, shape: float, scale: float) -> float:
    xs = np.sort(x)
    cdf = torch.special.gammainc(torch.tensor(shape, dtype=torch.float64),
                                 torch.from_numpy(xs / scale)).numpy()
    i = np.arange(1, len(xs) + 1)
    return float(max((i / len(xs) - cdf).max(), (cdf - (i - 1) / len(xs)).max()))


@pytest.mark.parametrize("rate,burstiness", [(5.0, 1.0), (5.0, 0.5), (2.0, 4.0)])
def test_gamma_gaps_have_the_mean_shape_and_distribution(rate, burstiness):
    x = gamma_intervals(N, rate, burstiness, np.random.default_rng(1234))
    mean = 1 / rate
    se = mean / math.sqrt(burstiness * N)
    assert abs(x.mean() - mean) < 4 * se, (x.mean(), mean)
    assert x.std() / x.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert ks_distance_to_gamma(x, burstiness, 1 / (rate * burstiness)) < 1.95 / math.sqrt(N)


def test_poisson_counts_per_window_have_poisson_dispersion():
    # a Poisson process at R per second: counts in windows of 1 s have mean = variance = R
    times = np.cumsum(gamma_intervals(N, 8.0, 1.0, np.random.default_rng(7)))
    counts = np.bincount(times.astype(int))[:-1]  # whole windows only
    assert counts.mean() == pytest.approx(8.0, rel=0.03)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)  # dispersion index


def test_rate_arrivals_are_rescaled_to_end_at_n_over_r_and_are_reproducible():
    t = rate_arrivals(50, 10.0, 0.7, seed=3)
    assert t[-1] == pytest.approx(5.0) and (np.diff(t) >= 0).all() and t[0] > 0
    assert (t == rate_arrivals(50, 10.0, 0.7, seed=3)).all() and not (t == rate_arrivals(50, 10.0, 0.7, seed=4)).all()
    raw = rate_arrivals(50, 10.0, 0.7, seed=3, normalize=False)
    assert t == pytest.approx(raw * (5.0 / raw[-1]))
    assert rate_arrivals(4, float("inf"), 1.0).tolist() == [0, 0, 0, 0]
    assert rate_arrivals(4, 2.0, float("inf")) == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_trace_arrivals_count_from_the_earliest_and_scale():
    assert trace_arrivals([10.0, 12.5, 11.0], 0.5) == pytest.approx([0.0, 1.25, 0.5])


@pytest.mark.parametrize("call", [lambda: gamma_intervals(3, -1.0, 1.0, np.random.default_rng()),
                                  lambda: gamma_intervals(3, 1.0, 0.0, np.random.default_rng()),
                                  lambda: rate_arrivals(3, float("nan")),
                                  lambda: trace_arrivals([1.0], 0.0),
                                  lambda: trace_arrivals([1.0, float("inf")])])
def test_out_of_range_arguments_raise(call):
    with pytest.raises(ValueError):
        call()
