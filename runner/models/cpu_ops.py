"""Fused float32 elementwise ops of the Llama-family forward on the CPU, from torch tensors.

The compiled module ``_cpu_ops.pyx`` does in one pass over the rows what the forward
otherwise does in several torch kernels:

* :func:`fused_add_rms_norm`: ``residual += x; x = RMSNorm(residual)`` in place (vLLM's
  ``fused_add_rms_norm`` semantics: the residual stream and the normalised input of the
  next sub-block in one call; replaces ``add`` + ``pow`` + ``mean`` + ``add`` + ``rsqrt`` +
  ``mul`` + ``mul``);
* :func:`rms_norm`: the same without the residual (the first layer's input norm);
* :func:`rope`: RoPE of q or k from the step's ``cos`` / ``sin`` (``rope.py``'s conventions,
  both pairings) into a fresh contiguous tensor (the ``split`` views of the fused q/k/v
  output in, ``cat`` of four products out, in one pass).

SiLU-and-mul has its own wrapper, ``silu_mul.py``: its C pass calls torch's vectorised Sleef
``exp`` to round exactly as torch's ``silu`` then ``mul`` (a scalar-``exp`` C pass was 4-5x
slower than torch's two ops: docs/performance.md, "The forward's small ops, session 13").

Numerics: the products and sums are rounded as torch's separate kernels round them; the
sum of squares of RMSNorm is accumulated in a different order (16 float32 lanes), so a
normalised row may differ from torch's in the last bit. A row's result does not depend on
the thread count or on the other rows.

The module is an optional build product (pyproject.toml's ext-modules); :func:`enabled`
says whether the forward uses it. Callers check :func:`takes` on their tensors and keep
the torch ops otherwise (another dtype or device, ``torch.compile`` tracing).
"""

from __future__ import annotations

import os

import torch

from attnplug.core import switches

try:
    from attnplug.runner.models import _cpu_ops
except ImportError:  # not compiled (no C compiler at install): the torch ops run
    _cpu_ops = None

ENV_SWITCH = "ATTNPLUG_CPU_FUSED_OPS"
"""``ATTNPLUG_CPU_FUSED_OPS=0`` turns the fused ops off (the torch ops run, as in a build
without the compiled module): for measuring one against the other (docs/performance.md).
Read when a model's forward starts."""

NS_PER_ELEMENT = {"rms_norm": 0.2, "fused_add_rms_norm": 0.25, "rope": 0.3, "silu_mul": 0.4}
"""One thread's time per element of each op, in ns (float32; the elements counted are the
input's: ``rows * hidden_size``, ``rows * heads * head_size``), measured on
this project's 2-core machine (docs/performance.md, "Two threads (issue 38, session 13)"):
:func:`threads_for` estimates a call's work from it. Re-measure an op's figure when its kernel
changes."""

PARALLEL_MIN_WORK_US = 6.0
"""Below this much estimated one-thread work (µs) a call runs on one thread while torch's
OpenMP threads spin between parallel regions (libgomp's default): a region's start and
barrier cost ~2–3 µs there, so RMSNorm of 32k elements (6.5 µs) gains 1.13× from a second
thread and of 16k (3.3 µs) nothing."""

PARALLEL_MIN_WORK_US_PASSIVE = 200.0
"""The same while the threads sleep between regions (``OMP_WAIT_POLICY=PASSIVE``, which
``runner/commands/threads.py`` sets on a shared machine): waking the sleeping thread costs
~50–100 µs there, so RMSNorm breaks even only at ~500k elements (~130 µs) (and the
C SiLU-and-mul this project had then gained 1.17× at 131k, ~220 µs)."""

_wait_passive = (os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
                 or os.environ.get("GOMP_SPINCOUNT", "").strip() == "0")
"""Whether torch's OpenMP threads sleep between parallel regions (libgomp read its
environment when torch loaded it, before this module); :func:`set_wait_passive` tells it
when the variable was set only for that load."""


def available() -> bool:
    """The compiled module was built and imports."""
    return _cpu_ops is not None


def enabled() -> bool:
    """The forward uses the fused ops: the module is built and ``ATTNPLUG_CPU_FUSED_OPS``
    is not ``0``."""
    return _cpu_ops is not None and switches.flag(ENV_SWITCH)


def takes(x: torch.Tensor) -> bool:
    """The ops take ``x``: float32 on the CPU, its last dimension contiguous, not traced by
    ``torch.compile``, autograd not recording (the ops write through raw pointers: no
    gradient)."""
    return _layout_ok(x) and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def _layout_ok(x: torch.Tensor) -> bool:
    return x.dtype is _F32 and x.is_cpu and x.dim() > 0 and x.stride(-1) == 1  # cheapest tests first


_F32 = torch.float32


def set_wait_passive(passive: bool) -> None:
    """Record whether torch's OpenMP threads sleep between parallel regions (``True``:
    ``OMP_WAIT_POLICY=PASSIVE`` was in the environment when torch loaded libgomp), which
    picks :data:`PARALLEL_MIN_WORK_US_PASSIVE` over :data:`PARALLEL_MIN_WORK_US`."""
    global _wait_passive
    _wait_passive = bool(passive)


def parallel_min_work_us() -> float:
    """The estimated one-thread work (µs) from which a call uses torch's threads."""
    return PARALLEL_MIN_WORK_US_PASSIVE if _wait_passive else PARALLEL_MIN_WORK_US


def threads_for(op: str, elements: int, num_threads: int | None = None) -> int:
    """Threads for one call of ``op`` (a key of :data:`NS_PER_ELEMENT`) over ``elements``
    input elements: ``num_threads`` (default ``torch.get_num_threads()``) when the estimated
    work ``elements * NS_PER_ELEMENT[op]`` reaches :func:`parallel_min_work_us`, else 1."""
    n = torch.get_num_threads() if num_threads is None else num_threads
    if n <= 1:
        return 1
    return n if elements * NS_PER_ELEMENT[op] >= parallel_min_work_us() * 1e3 else 1


def _check_rows(name: str, x: torch.Tensor, width: int | None = None) -> None:
    if x.dim() != 2 or not _layout_ok(x):
        raise ValueError(f"{name}: expected a 2-D float32 CPU tensor with a contiguous last dimension, got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device} with strides {x.stride()}")
    if width is not None and x.shape[1] != width:
        raise ValueError(f"{name}: expected {width} columns, got {x.shape[1]}")


def _check_weight(weight: torch.Tensor, d: int) -> None:
    if weight.shape != (d,) or not weight.is_contiguous() or not _layout_ok(weight):
        raise ValueError(f"weight: expected a contiguous float32 CPU [{d}], got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` (HF ``LlamaRMSNorm`` in float32).

    Args:
        x: ``[num_tokens, hidden_size]`` float32, CPU, last dimension contiguous.
        weight: ``[hidden_size]`` float32, contiguous.
        eps: added to the mean square.

    Returns:
        A new contiguous ``[num_tokens, hidden_size]`` float32 tensor.

    Raises:
        ValueError: a tensor of another shape, dtype, device or layout (nothing written).
    """
    _check_rows("x", x)
    n, d = x.shape
    _check_weight(weight, d)
    out = torch.empty((n, d), dtype=torch.float32)
    _cpu_ops.rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), d, n, d, float(eps),
                      threads_for("rms_norm", n * d))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``residual += x``, then ``x = weight * (residual * rsqrt(mean(residual^2, -1) + eps))``,
    both in place (vLLM's ``fused_add_rms_norm``).

    Args:
        x: ``[num_tokens, hidden_size]`` float32, CPU, last dimension contiguous: a sub-block's
            output in, the next sub-block's normalised input out.
        residual: the residual stream, same shape and layout rules, not overlapping ``x``.
        weight: ``[hidden_size]`` float32, contiguous.
        eps: added to the mean square.

    Raises:
        ValueError: a tensor of another shape, dtype, device or layout, or ``x`` and
            ``residual`` sharing storage (nothing written).
    """
    _check_rows("x", x)
    n, d = x.shape
    _check_rows("residual", residual, d)
    if residual.shape[0] != n:
        raise ValueError(f"residual: expected {n} rows, got {residual.shape[0]}")
    _check_weight(weight, d)
    if x.untyped_storage().data_ptr() == residual.untyped_storage().data_ptr():
        raise ValueError("x and residual share storage")
    _cpu_ops.fused_add_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                                weight.data_ptr(), n, d, float(eps), threads_for("fused_add_rms_norm", n * d))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
         interleaved: bool = False) -> torch.Tensor:
    """RoPE of every head of ``x`` (``rope.py``'s :func:`~attnplug.runner.models.rope.rotate`
    on the first ``rotary_dim`` dimensions, the rest copied), into a new tensor.

    Args:
        x: ``[num_tokens, num_heads, head_size]`` float32, CPU, last dimension contiguous
            (a column view of the fused q/k/v output is fine).
        cos, sin: ``[num_tokens, 1, rotary_dim // 2]`` float32, last dimension contiguous
            (``RotaryEmbedding.cos_sin``).
        rotary_dim: rotated leading dimensions of a head (even, ``<= head_size``).
        interleaved: pair ``(2i, 2i + 1)`` (output de-interleaved) instead of ``(i, i + rotary_dim / 2)``.

    Returns:
        A new contiguous tensor of ``x``'s shape.

    Raises:
        ValueError: a tensor of another shape, dtype, device or layout, or a bad ``rotary_dim``.
    """
    if x.dim() != 3 or not _layout_ok(x):
        raise ValueError(f"x: expected a 3-D float32 CPU tensor with a contiguous last dimension, got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device} with strides {x.stride()}")
    n, heads, head_size = x.shape
    _check_cos_sin(cos, sin, n, rotary_dim, head_size)
    out = torch.empty((n, heads, head_size), dtype=torch.float32)
    _cpu_ops.rope(x.data_ptr(), x.stride(0), x.stride(1), out.data_ptr(), heads * head_size, head_size,
                  cos.data_ptr(), sin.data_ptr(), cos.stride(0), n, heads, head_size, rotary_dim,
                  bool(interleaved), threads_for("rope", n * heads * head_size))
    return out


def rope_qk(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int, cos: torch.Tensor,
            sin: torch.Tensor, rotary_dim: int, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope` of the q and of the k columns of a fused q/k/v projection's output, read
    in place (no split, no views), into two new tensors: one check of the shared arguments
    and two C calls (the decoder layer's step, where the two :func:`rope` calls' checks cost
    as much as their work at decode sizes; docs/performance.md, "The q/k RoPE from the fused
    output").

    Args:
        qkv: ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]`` float32, CPU, last
            dimension contiguous: q's heads, then k's, then v's (not read).
        num_heads, num_kv_heads, head_size: q's and k's head counts and the head size.
        cos, sin, rotary_dim, interleaved: as for :func:`rope`.

    Returns:
        ``(q, k)``: new contiguous ``[num_tokens, num_heads, head_size]`` and
        ``[num_tokens, num_kv_heads, head_size]`` float32 tensors.

    Raises:
        ValueError: a tensor of another shape, dtype, device or layout, a head count below 1
            or a bad ``rotary_dim`` (nothing written).
    """
    _check_rows("qkv", qkv)
    n, width = qkv.shape
    if num_heads < 1 or num_kv_heads < 1 or head_size < 1:
        raise ValueError(f"heads {num_heads}, {num_kv_heads} of size {head_size}: expected positive counts")
    if width != (num_heads + 2 * num_kv_heads) * head_size:
        raise ValueError(f"qkv: expected ({num_heads} + 2 * {num_kv_heads}) * {head_size} = "
                         f"{(num_heads + 2 * num_kv_heads) * head_size} columns, got {width}")
    _check_cos_sin(cos, sin, n, rotary_dim, head_size)
    q = torch.empty((n, num_heads, head_size), dtype=torch.float32)
    k = torch.empty((n, num_kv_heads, head_size), dtype=torch.float32)
    base, tok, cs, cs_tok = qkv.data_ptr(), qkv.stride(0), (cos.data_ptr(), sin.data_ptr()), cos.stride(0)
    for out, first, heads in ((q, 0, num_heads), (k, num_heads, num_kv_heads)):
        _cpu_ops.rope(base + 4 * first * head_size, tok, head_size, out.data_ptr(), heads * head_size, head_size,
                      *cs, cs_tok, n, heads, head_size, rotary_dim, bool(interleaved),
                      threads_for("rope", n * heads * head_size))
    return q, k


def _check_cos_sin(cos: torch.Tensor, sin: torch.Tensor, n: int, rotary_dim: int, head_size: int) -> None:
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"rotary_dim {rotary_dim}: expected an even number in [2, {head_size}]")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (n, 1, rotary_dim // 2) or not _layout_ok(t):
            raise ValueError(f"{name}: expected float32 CPU [{n}, 1, {rotary_dim // 2}] with a contiguous last "
                             f"dimension, got {tuple(t.shape)} {t.dtype} on {t.device}")
    if cos.stride(0) != sin.stride(0):
        raise ValueError(f"cos and sin: different token strides {cos.stride(0)} and {sin.stride(0)}")


def bind_threads(cpu_sets: list[list[int]]) -> None:
    """Pin thread ``t`` of torch's OpenMP team of ``len(cpu_sets)`` threads to the CPUs
    ``cpu_sets[t]``, each thread calling ``sched_setaffinity`` for itself inside one parallel
    region of the compiled module; torch links the same ``libgomp.so.1`` (one is loaded), which
    keeps that team for later regions of the same size, so torch's ops run on the pinned
    threads (``runner/commands/threads.py``, ``ATTNPLUG_OMP_BIND``). ``[[all CPUs]] * n``
    unpins.

    Raises:
        RuntimeError: the compiled module is not built, or some thread's call failed (a CPU
            outside the process's set).
        ValueError: an empty ``cpu_sets`` or an empty set.
    """
    if _cpu_ops is None:
        raise RuntimeError("binding OpenMP threads needs the compiled module attnplug.runner.models._cpu_ops")
    if not cpu_sets or any(not cs for cs in cpu_sets):
        raise ValueError(f"cpu_sets: one non-empty list of CPUs per thread, got {cpu_sets!r}")
    failed = _cpu_ops.bind_threads([list(map(int, cs)) for cs in cpu_sets])
    if failed:
        raise RuntimeError(f"sched_setaffinity failed on {failed} of {len(cpu_sets)} threads ({cpu_sets!r})")


__all__ = ["ENV_SWITCH", "NS_PER_ELEMENT", "PARALLEL_MIN_WORK_US", "PARALLEL_MIN_WORK_US_PASSIVE", "available", "bind_threads",
           "enabled", "fused_add_rms_norm", "parallel_min_work_us", "rms_norm", "rope", "rope_qk", "set_wait_passive",
           "takes", "threads_for"]
