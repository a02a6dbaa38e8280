"""``CpuGpuBuffer``: a persistent host tensor, its numpy view and its device twin.

Allocated once at the maximum size; each step fills a prefix on the host (through the
numpy view) and copies that prefix to the device with one non-blocking copy. When the
device is the CPU the "device" tensor *is* the host tensor: no copy happens at all.
"""

from __future__ import annotations

import numpy as np
import torch

from attnplug.core.devices import resolve_device


def pin_memory_available(device: torch.device) -> bool:
    """Whether host buffers feeding ``device`` should be pinned (CUDA present and targeted)."""
    return device.type == "cuda" and torch.cuda.is_available()


def upload(array: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A one-off host array (or CPU tensor) on ``device`` without synchronising the host.

    On CUDA the array is staged through a pinned tensor from torch's caching host
    allocator and copied non-blocking (the allocator holds that pinned block until the
    copy has run, so the staging memory is never reused early); a plain ``.to(device)``
    of pageable memory would be a synchronising ``cudaMemcpy``. On the CPU the result
    shares ``array``'s memory (no copy).

    Args:
        array: a numpy array or a CPU tensor, any shape and numeric dtype, contiguous or not
            (copied when staged).
        device: the target device.

    Returns:
        a tensor of ``array``'s shape and dtype on ``device`` (``array``'s own memory on the
        CPU, a tensor given as one).
    """
    host = array if isinstance(array, torch.Tensor) else torch.from_numpy(array)
    if device.type == "cpu":
        return host
    if pin_memory_available(device):
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class CpuGpuBuffer:
    """A host/device pair of equal-shape tensors.

    Attributes:
        cpu: the host tensor (pinned when the device is CUDA).
        np: a numpy view of ``cpu`` (shares memory).
        gpu: the device tensor; ``gpu is cpu`` when the device is the CPU.

    Args:
        shape: the full (maximum) shape.
        dtype: the torch dtype.
        device: where ``gpu`` lives.
        fill: the initial value of every element.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 fill: int | float = 0):
        self.device = resolve_device(device)
        pin = pin_memory_available(self.device)
        self.cpu = torch.full(shape, fill, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.aliased = self.device.type == "cpu"
        self.gpu = self.cpu if self.aliased else torch.full(shape, fill, dtype=dtype, device=self.device)
        self._cpu_view: tuple[int, torch.Tensor] = (-1, self.cpu)
        self._gpu_view: tuple[int, torch.Tensor] = (-1, self.gpu)

    def cpu_view(self, n: int) -> torch.Tensor:
        """``cpu[:n]`` (the same view object while ``n`` does not change: slicing a tensor
        costs more than the arithmetic of a small step)."""
        if self._cpu_view[0] != n:
            self._cpu_view = (n, self.cpu[:n])
        return self._cpu_view[1]

    def gpu_view(self, n: int) -> torch.Tensor:
        """``gpu[:n]``, cached like :meth:`cpu_view`."""
        if self._gpu_view[0] != n:
            self._gpu_view = (n, self.gpu[:n])
        return self._gpu_view[1]

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows (all when ``None``) host → device; return that device slice.

        Non-blocking from pinned memory (no host sync); a no-op when the device is the CPU.
        """
        if n is None:
            if not self.aliased:
                self.gpu.copy_(self.cpu, non_blocking=True)
            return self.gpu
        view = self.gpu_view(n)
        if not self.aliased:
            view.copy_(self.cpu_view(n), non_blocking=True)
        return view
