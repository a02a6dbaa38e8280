"""One torch thread in the test process while tests/distributed runs (restored after).

Its ranks already run with one thread each (``dist_ranks._entry``, ``OMP_NUM_THREADS=1`` for
torchrun), and the test process computes the one-process and HF references next to them.
On a loaded 2-core machine two OpenMP threads made those references' tiny matmuls about
800x slower (16 ms instead of 21 µs for a ``[64, 96] x [96, 96]`` linear, load average 5.8),
so the tests' time followed the machine's load rather than their work."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
