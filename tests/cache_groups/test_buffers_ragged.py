"""``CpuGpuBuffer`` (cache_groups/buffers.py) and the ragged-batch index helpers
(cache_groups/ragged.py), against expectations written out by hand or by a Python loop.

The ``meta`` device stands in for an accelerator here: it is a real device other than the
CPU (so the buffer keeps a separate device twin and copies into it, with torch's shape
checks), and exists on every machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.cache_groups import ragged
from attnplug.cache_groups.buffers import CpuGpuBuffer, pin_memory_available
from attnplug.cache_groups.ragged import cumsum_and_arange, repeat_indices


# --- CpuGpuBuffer -------------------------------------------------------------------------
def test_pinning_is_wanted_only_for_an_available_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pin_memory_available(torch.device("cuda", 0)) is True
    assert pin_memory_available(torch.device("cpu")) is False
    assert pin_memory_available(torch.device("meta")) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pin_memory_available(torch.device("cuda", 0)) is False


def test_on_the_cpu_the_device_tensor_is_the_host_tensor_filled_with_zeros_by_default():
    b = CpuGpuBuffer((2, 3), torch.int32, "cpu")
    assert b.aliased and b.gpu is b.cpu and b.device == torch.device("cpu")
    assert b.cpu.dtype == torch.int32 and b.cpu.shape == (2, 3)
    assert b.cpu.tolist() == [[0, 0, 0], [0, 0, 0]]
    b.np[1, 2] = 7  # the numpy view shares the host memory
    assert b.cpu[1, 2].item() == 7 and b.copy_to_gpu() is b.gpu and b.gpu[1, 2].item() == 7
    f = CpuGpuBuffer((4,), torch.float64, torch.device("cpu"), fill=-1.5)
    assert f.cpu.tolist() == [-1.5] * 4 and f.np.dtype == np.float64


def test_views_are_prefixes_reused_while_the_length_holds():
    b = CpuGpuBuffer((5,), torch.int64, "cpu", fill=3)
    b.np[:] = np.arange(5)
    v0 = b.cpu_view(0)
    assert v0.shape == (0,)
    v2 = b.cpu_view(2)
    assert v2.tolist() == [0, 1] and b.cpu_view(2) is v2 and b.cpu_view(3).tolist() == [0, 1, 2]
    assert b.cpu_view(5).tolist() == [0, 1, 2, 3, 4]
    g = b.gpu_view(4)
    assert g.tolist() == [0, 1, 2, 3] and b.gpu_view(4) is g
    assert b.copy_to_gpu(2).tolist() == [0, 1] and b.copy_to_gpu(2) is b.gpu_view(2)


@pytest.mark.parametrize("n", [0, 1, 2])
def test_the_first_view_of_a_fresh_buffer_has_n_rows(n):
    for dev in ("cpu", "meta"):
        assert CpuGpuBuffer((3,), torch.int32, dev).cpu_view(n).shape == (n,)
        assert CpuGpuBuffer((3,), torch.int32, dev).gpu_view(n).shape == (n,)
        assert CpuGpuBuffer((3,), torch.int32, dev).copy_to_gpu(n).shape == (n,)


def test_on_another_device_the_twin_lives_there_and_copies_take_the_prefix():
    b = CpuGpuBuffer((6, 2), torch.int32, "meta", fill=4)
    assert not b.aliased and b.device == torch.device("meta")
    assert b.gpu is not b.cpu and b.gpu.device.type == "meta"
    assert b.gpu.shape == (6, 2) and b.gpu.dtype == torch.int32
    assert b.cpu.device.type == "cpu" and b.cpu.tolist() == [[4, 4]] * 6
    v = b.copy_to_gpu(3)
    assert v.device.type == "meta" and v.shape == (3, 2) and b.copy_to_gpu(3) is v
    assert b.copy_to_gpu(0).shape == (0, 2)
    whole = b.copy_to_gpu()
    assert whole is b.gpu and whole.shape == (6, 2)


# --- ragged -------------------------------------------------------------------------------
def loop_reference(counts):
    cu, ar, idx, total = [], [], [], 0
    for i, c in enumerate(counts):
        total += c
        cu.append(total)
        ar.extend(range(c))
        idx.extend([i] * c)
    return cu, ar, idx


@pytest.mark.parametrize("counts", [[2, 5, 3], [0, 4, 0, 1], [1], [0], [0, 0], [7, 0]])
def test_cumsum_arange_and_repeat_match_a_loop(counts):
    cu, ar, idx = loop_reference(counts)
    for buf in (None, np.arange(20, dtype=np.int64)):
        got_cu, got_ar = cumsum_and_arange(np.array(counts, dtype=np.int32), buf)
        assert got_cu.dtype == np.int64 and got_ar.dtype == np.int64
        assert got_cu.tolist() == cu and got_ar.tolist() == ar
        got_idx = repeat_indices(np.array(counts), buf)
        assert got_idx.dtype == np.int64 and got_idx.tolist() == idx
    assert cumsum_and_arange(counts)[1].tolist() == ar  # a plain list is accepted


def test_no_requests_give_empty_arrays():
    for buf in (None, np.arange(4, dtype=np.int64)):
        cu, ar = cumsum_and_arange(np.zeros(0, dtype=np.int64), buf)
        assert cu.shape == (0,) and ar.shape == (0,)
        assert repeat_indices(np.zeros(0, dtype=np.int64), buf).shape == (0,)


def test_a_given_arange_buffer_replaces_the_fresh_arange(monkeypatch):
    counts = np.array([3, 1, 2])
    buf = np.arange(8, dtype=np.int64)

    def no_arange(*a, **k):
        raise AssertionError("allocated a fresh arange although arange_buffer was given")

    with monkeypatch.context() as m:
        m.setattr(ragged.np, "arange", no_arange)
        cu, ar = cumsum_and_arange(counts, buf)
        idx = repeat_indices(counts, buf)
    assert cu.tolist() == [3, 4, 6] and ar.tolist() == [0, 1, 2, 0, 0, 1]
    assert idx.tolist() == [0, 0, 0, 1, 2, 2]
    assert buf.tolist() == list(range(8))  # read, not written
