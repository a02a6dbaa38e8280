"""SiLU-and-mul in one pass on the CPU, rounded exactly as torch's ``silu`` then ``mul``.

``SwiGLUMLP`` computes ``silu(gate) * up`` on the two column halves of the fused gate/up
projection's output. torch does that in two kernels (``silu`` writes a buffer, ``mul_`` reads
it back); :func:`silu_mul` does it in one pass of the compiled module (``_cpu_ops.pyx``) and
gives the same bits: on a CPU where torch's kernels run at its ``AVX512`` capability
(``torch.backends.cpu.get_cpu_capability()``), ATen's float32 ``silu`` computes
``x / (1 + exp(-x))`` over each contiguous run of a row in blocks of two 16-lane vectors with
Sleef's ``Sleef_expf16_u10`` and the run's last ``len % 32`` elements one at a time with
``std::exp`` (ATen's ``vectorized_loop``, ``aten/src/ATen/native/cpu/Loops.h``). The compiled
pass calls the same Sleef function — torch's own, found by name in ``libtorch_cpu.so``,
which exports it — and libm's ``expf`` for the rows' tails. A torch split of the rows over
threads starts a run mid-row; the result is still the same wherever each run starts 32
elements into a row (:func:`rounds_like_torch`), and torch's split is computed here from its
rule (``at::parallel_for`` over the elements, ``at::internal::GRAIN_SIZE`` of 32,768 a thread).
Anywhere else (another capability, no compiled module, autograd, other dtypes) the caller
keeps torch's two ops. Bit-identity is tested (``tests/runner/models/test_silu_mul_matches_torch.py``).
"""

from __future__ import annotations

import ctypes
import os

import torch

from attnplug.runner.models import cpu_ops

TORCH_GRAIN = 32768
"""``at::internal::GRAIN_SIZE``: TensorIterator splits an elementwise op over threads only from
this many elements, into ``ceil(numel / threads)``-element runs."""

TORCH_BLOCK = 32
"""Elements per iteration of ATen's vectorised loop at the AVX512 capability (two 16-lane vectors)."""

_exp16_state: list = []  # [ready: bool], filled on the first call of ready()


def ready() -> bool:
    """The compiled module is built with ``silu_mul``, torch's kernels run at ``AVX512``, and
    ``Sleef_expf16_u10`` was found in torch's ``libtorch_cpu.so`` and handed to the module
    (decided once)."""
    if not _exp16_state:
        _exp16_state.append(_resolve_exp16())
    return _exp16_state[0]


def _resolve_exp16() -> bool:
    native = cpu_ops._cpu_ops
    if native is None or not getattr(native, "HAVE_SILU_MUL", False):
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        address = ctypes.cast(lib.Sleef_expf16_u10, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return False
    return bool(address) and native.set_exp16(address)


def rounds_like_torch(rows: int, width: int, threads: int) -> bool:
    """Whether torch's ``silu`` over a ``[rows, width]`` operand at ``threads`` threads starts
    every run of a row at a multiple of :data:`TORCH_BLOCK` elements into it (then its scalar
    tails sit where :func:`silu_mul`'s do: at each row's end)."""
    numel = rows * width
    if threads <= 1 or numel < TORCH_GRAIN:
        return True
    used = min(threads, -(-numel // TORCH_GRAIN))
    chunk = -(-numel // used)
    return all((k * chunk) % width % TORCH_BLOCK == 0 for k in range(1, used))


def takes(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """:func:`silu_mul` may replace ``silu(gate) * up`` here: :func:`ready`, the fused ops on
    (``cpu_ops.enabled``), both operands as ``cpu_ops.takes`` wants them, 2-D of one shape, and
    torch's thread split alike (:func:`rounds_like_torch`)."""
    if not (ready() and cpu_ops.enabled() and cpu_ops.takes(gate) and cpu_ops._layout_ok(up)):
        return False
    if gate.dim() != 2 or up.shape != gate.shape:
        return False
    return rounds_like_torch(gate.shape[0], gate.shape[1], torch.get_num_threads())


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` into a new contiguous tensor, bit-identical to torch's two ops where
    :func:`takes` holds (module docstring).

    Args:
        gate, up: ``[num_tokens, intermediate_size]`` float32 CPU tensors, last dimension
            contiguous (the two column halves of the fused gate/up output are).

    Returns:
        A new ``[num_tokens, intermediate_size]`` float32 tensor.

    Raises:
        ValueError: another shape, dtype, device or layout, or :func:`ready` is false (nothing
            written).
    """
    if not ready():
        raise ValueError("silu_mul: not available here (no compiled module, or torch's CPU capability is not "
                         "AVX512): use torch's silu and mul")
    cpu_ops._check_rows("gate", gate)
    n, d = gate.shape
    cpu_ops._check_rows("up", up, d)
    if up.shape[0] != n:
        raise ValueError(f"up: expected {n} rows, got {up.shape[0]}")
    return _pass(gate, up)


def maybe_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """:func:`silu_mul`'s result where :func:`takes` holds, else ``None`` (the caller keeps
    torch's two ops): the forward's entry (``SwiGLUMLP``), which tests the conditions once per
    call: :func:`takes` implies every check :func:`silu_mul` makes.

    Args:
        gate, up: any tensors (``takes`` decides).

    Returns:
        A new ``[num_tokens, intermediate_size]`` float32 tensor, or ``None`` (nothing written).
    """
    return _pass(gate, up) if takes(gate, up) else None


def _pass(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The compiled pass on operands already checked (:func:`silu_mul`'s checks or :func:`takes`)."""
    n, d = gate.shape
    out = torch.empty((n, d), dtype=torch.float32)
    cpu_ops._cpu_ops.silu_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), d, n, d,
                              cpu_ops.threads_for("silu_mul", n * d))
    return out


__all__ = ["TORCH_BLOCK", "TORCH_GRAIN", "maybe_silu_mul", "ready", "rounds_like_torch", "silu_mul", "takes"]
