"""The Triton backend's size limits, in one leaf module.

The backend class declares them, the metadata builder checks block sizes, the impl
checks head sizes and the kernel wrapper checks head sizes before a launch; all of
them import from here, so none of those modules needs another to know a size. This
module imports nothing.
"""

from __future__ import annotations

MAX_HEAD_SIZE = 256
"""Largest head size the kernels take (the fp32 accumulator is ``BLOCK_M x head_size``)."""

HEAD_SIZES: tuple[int, ...] = tuple(range(16, MAX_HEAD_SIZE + 1, 16))
"""Head sizes the kernels take: multiples of 16 (the tensor-core K granularity) up to 256;
inside the kernel a head is padded to the next power of two (masked loads)."""

KERNEL_BLOCK_SIZES: tuple[int, ...] = (16, 32, 64)
"""Kernel block (page) sizes, tokens. A manager block size that is a multiple of one of
these is served by splitting each manager block into kernel blocks (128 -> 64, 48 -> 16)."""

FP8_E4M3_MIN_SM = 89
"""Compute capability (``10 * major + minor``) from which Triton converts to ``float8e4nv``
(an ``fp8_e4m3`` KV cache's write): compiling the KV write for sm_80 fails with "type
fp8e4nv not supported in this architecture" (triton 3.9, ``aot_check --full``); sm_80
takes ``fp8_e5m2``."""

__all__ = ["FP8_E4M3_MIN_SM", "HEAD_SIZES", "KERNEL_BLOCK_SIZES", "MAX_HEAD_SIZE"]
