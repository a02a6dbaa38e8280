"""Cascade attention end to end: with prefix caching, requests of a step share their first
blocks; the runner computes ``common_prefix_len`` per group, decides per step
(runner/execute/cascade.py), and every backend that declares ``supports_cascade`` gives the
same tokens and logits as with cascade off, with a shared prefix longer and shorter than
the threshold. Backends that do not declare it say why."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from attnplug.backends.emulators.backends import FlashAttn3EmulatedBackend
from attnplug.backends.flashinfer.backend import FlashInferBackend
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.backends.triton.backend import TritonBackend
from attnplug.runner.execute.cascade import CascadeConfig, common_prefix_len

sys.path.insert(0, str(Path(__file__).parent))
from shared_prefix_cascade import SharedPrefixRun, assert_cascade_on_equals_off  # noqa: E402

RUN = SharedPrefixRun(num_layers=2, max_position_embeddings=256, num_blocks=48, max_num_reqs=6, max_model_len=128,
                      max_tokens=3, num_sharing=3)


@pytest.mark.parametrize("backend, threshold", [
    (TorchNativeBackend, 16), (TorchNativeBackend, 64), (FlashAttn3EmulatedBackend, 16)],
    ids=["torch_native-prefix-above-threshold", "torch_native-prefix-below-threshold",
         "flash_attn3-emulated-prefix-above-threshold"])
def test_cascade_on_equals_cascade_off(backend, threshold):
    assert_cascade_on_equals_off(RUN, backend, threshold)


def test_the_decision_names_the_reason():
    runner, _ = RUN.run(TorchNativeBackend, CascadeConfig(min_prefix_len=16, min_num_reqs=5))
    assert runner.cascade.num_cascade_steps == 0
    assert any(r.endswith("< min_num_reqs 5") for r in runner.cascade.reason_counts), runner.cascade.reason_counts
    assert TritonBackend.get_builder_cls().supports_cascade  # tests/backends/triton/test_cascade_triton.py
    assert "MultiLevelCascadeAttentionWrapper" in FlashInferBackend.get_builder_cls().cascade_unsupported_reason


def test_common_prefix_len_counts_identical_real_leading_blocks_clamped_to_the_shortest_context():
    bt = np.array([[3, 4, 5, 9], [3, 4, 6, 0], [3, 4, 5, 7]])
    nb = np.array([4, 3, 4])
    assert common_prefix_len(bt, nb, np.array([40, 40, 40]), 16, 16) == 32
    assert common_prefix_len(bt, nb, np.array([40, 20, 40]), 16, 16) == 16  # clamp, then round down
    assert common_prefix_len(bt, nb, np.array([40, 20, 40]), 16, 4) == 20  # rounded to the kernel block
    assert common_prefix_len(np.array([[0, 4], [0, 4]]), np.array([2, 2]), np.array([32, 32]), 16, 16) == 0
    assert common_prefix_len(bt[:, :0], nb * 0, np.array([5, 5, 5]), 16, 16) == 0
