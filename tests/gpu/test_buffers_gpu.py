"""``CpuGpuBuffer`` on CUDA (marker ``gpu``; skipped without CUDA): the host tensor is
pinned, the device twin starts with the fill value, and ``copy_to_gpu(n)`` copies exactly
the first ``n`` rows. Kills the CPU-equivalent mutants of cache_groups/buffers.py listed in
docs/mutation-testing.md (a host tensor that is not pinned; a twin on the CPU). Not run in the
session that wrote it (no GPU was lent)."""

from __future__ import annotations

import pytest
import torch

from attnplug.cache_groups.buffers import CpuGpuBuffer, pin_memory_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")]


def test_cuda_buffer_is_pinned_and_copies_the_prefix():
    assert pin_memory_available(torch.device("cuda", 0)) is True
    b = CpuGpuBuffer((5, 2), torch.int32, "cuda", fill=-3)
    assert not b.aliased and b.cpu.is_pinned() and b.gpu.device.type == "cuda"
    assert b.gpu.cpu().tolist() == [[-3, -3]] * 5
    b.np[:] = [[i, i] for i in range(5)]
    v = b.copy_to_gpu(2)
    torch.cuda.synchronize()
    assert v.device.type == "cuda" and v.cpu().tolist() == [[0, 0], [1, 1]]
    assert b.gpu.cpu().tolist() == [[0, 0], [1, 1]] + [[-3, -3]] * 3
    b.copy_to_gpu()
    torch.cuda.synchronize()
    assert b.gpu.cpu().tolist() == [[i, i] for i in range(5)]
