"""The fused CPU ops (runner/models/cpu_ops.py) use torch's threads only when a call's estimated
one-thread work (``elements * NS_PER_ELEMENT[op]``) pays for a parallel region: from 6 µs
while the OpenMP threads spin, from 200 µs while they sleep (the passive wait policy of a
shared machine). Figures: docs/performance.md, "Two threads (issue 38, session 13)"."""

from __future__ import annotations

import pytest
import torch

from attnplug.runner.models import cpu_ops


@pytest.fixture
def policy():
    before = cpu_ops._wait_passive  # noqa: SLF001
    yield cpu_ops.set_wait_passive
    cpu_ops.set_wait_passive(before)


def test_spinning_threads_split_a_prefill_s_rope_but_not_tiny_llamas_decode_norm(policy):
    policy(False)
    assert cpu_ops.threads_for("rope", 128 * 9 * 64, 2) == 2  # 22 µs
    assert cpu_ops.threads_for("rms_norm", 128 * 256, 2) == 2  # 6.5 µs: 1.13x
    assert cpu_ops.threads_for("rms_norm", 64 * 256, 2) == 1  # 3.3 µs: no gain
    assert cpu_ops.threads_for("rope", 64 * 8 * 32, 2) == 1
    assert cpu_ops.threads_for("fused_add_rms_norm", 16 * 576, 2) == 1


def test_sleeping_threads_need_far_more_work(policy):
    policy(True)
    assert cpu_ops.threads_for("rope", 256 * 9 * 64, 2) == 1  # 44 µs: the wake-up is ~50-100 µs
    assert cpu_ops.threads_for("rms_norm", 512 * 256, 2) == 1  # 0.21x on two threads, measured
    assert cpu_ops.threads_for("rope", 2048 * 8 * 32, 2) == 1
    assert cpu_ops.threads_for("fused_add_rms_norm", 2048 * 576, 2) == 2  # 295 µs
    assert cpu_ops.threads_for("rms_norm", 1 << 20, 2) == 2


def test_one_thread_stays_one_and_the_default_is_torchs_count(policy):
    policy(False)
    assert cpu_ops.threads_for("rope", 1 << 22, 1) == 1
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpu_ops.threads_for("rope", 1 << 22) == 2
    finally:
        torch.set_num_threads(before)

