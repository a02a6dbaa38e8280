"""The compiled paged-attention kernel of ``cpu_sdpa`` (``_paged.pyx``), from torch tensors.

The kernel reads K/V in place through the block table: one call per layer attends every
query row of the given requests — decodes, speculative rows, prefills, chunked-prefill
continuations — bottom-right causal over each request's cached context (vLLM's
``query_start_loc`` / ``seq_lens`` / ``block_table`` convention), with an optional sliding
window and logits soft-cap, online softmax in float32 per ``(request, KV head)`` for the
whole GQA group. No gather, no padding, no mask. Nothing outside a request's keys from its
first query row's window start to ``seq_len - 1`` is read (within that span, a key a
row does not see has its K read for the tile's dot products, masked to ``-inf`` before
the softmax, and its V never read); a NaN in a key or value a row sees makes that row NaN.

The module is an optional build product (pyproject.toml's ext-modules): :func:`available`
says whether it is there, :func:`unsupported` whether it takes a layer. ``cpu_sdpa`` falls
back to its SDPA path where either says no (docs/backends.md).
"""

from __future__ import annotations

import torch

from attnplug.core import switches
from attnplug.core.errors import MetadataError

try:
    from attnplug.backends.cpu_sdpa import _paged
except ImportError:  # not compiled (no C compiler at install): the SDPA path runs
    _paged = None

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
if _paged is not None and _paged.HAS_FLOAT16:
    _DTYPE_CODES[torch.float16] = 2

ENV_SWITCH = "ATTNPLUG_CPU_PAGED_KERNEL"
"""``ATTNPLUG_CPU_PAGED_KERNEL=0`` turns the kernel off (``cpu_sdpa`` runs its SDPA path
everywhere, as a build without the compiled module does): for measuring one against the
other in a whole run (docs/performance.md)."""

HEAD_SIZE_MULTIPLE = 8
"""The kernel's dot products run 8 lanes wide: head sizes must be multiples of 8."""


def available() -> bool:
    """The compiled module was built and imports."""
    return _paged is not None


def unsupported(dtype: torch.dtype, kv_cache_dtype: torch.dtype | None, head_size: int, causal: bool = True,
                sliding_window: int | None = None) -> str | None:
    """Why the kernel cannot run a layer (``None`` when it can): no compiled module, turned
    off by ``ATTNPLUG_CPU_PAGED_KERNEL=0``, a dtype other than float32 / bfloat16 / float16 (float16 only where the C compiler has
    ``_Float16``), a KV cache in another dtype than the queries (fp8), a head size not a
    multiple of 8 or above 256, a sliding window without causal attention."""
    if _paged is None:
        return "the compiled module attnplug.backends.cpu_sdpa._paged is not built"
    if not switches.flag(ENV_SWITCH):
        return f"turned off by {ENV_SWITCH}=0"
    if dtype not in _DTYPE_CODES:
        return f"dtype {dtype} (kernel: {', '.join(map(str, _DTYPE_CODES))})"
    if kv_cache_dtype is not None and kv_cache_dtype != dtype:
        return f"KV cache dtype {kv_cache_dtype} differs from {dtype}"
    if head_size % HEAD_SIZE_MULTIPLE or head_size > _paged.MAX_HEAD_SIZE:
        return f"head size {head_size} (kernel: multiples of 8 up to {_paged.MAX_HEAD_SIZE})"
    if sliding_window is not None and not causal:
        return "a sliding window without causal attention"
    return None


def paged_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, reqs: torch.Tensor, *, scale: float,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None, causal: bool = True,
                    num_threads: int | None = None) -> torch.Tensor:
    """Attend the query rows of requests ``reqs`` over the paged cache, writing ``out``.

    Args:
        out: ``[num_tokens, num_heads, head_size]``, ``query.dtype``, written in place for
            the rows of ``reqs`` only (last dim contiguous).
        query: ``[num_tokens, num_heads, head_size]``, float32 / bfloat16 / float16 (last
            dim contiguous); row ``query_start_loc[r] + i`` is request ``r``'s query ``i``,
            at position ``seq_lens[r] - query_len_r + i`` (bottom-right aligned).
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` in ``query.dtype``
            (K at index 0 of dim 1; last dim contiguous), this step's K/V already written.
        block_table: ``[num_reqs, max_blocks]``, ``torch.int32`` (last dim contiguous):
            request ``r``'s key position ``j`` is slot ``j % block_size`` of block
            ``block_table[r, j // block_size]``; for a sliding window only the blocks a
            window reaches are read.
        query_start_loc: ``[num_reqs + 1]``, ``torch.int32``, contiguous.
        seq_lens: ``[num_reqs]``, ``torch.int32``, contiguous (tokens of KV after the step).
        reqs: ``[n]``, ``torch.int64``, contiguous: the requests to attend.
        scale: the logit scale (``head_size ** -0.5`` usually).
        sliding_window: ``W`` (a query at ``p`` sees keys ``p - W + 1 .. p``) or ``None``.
        logits_soft_cap: ``cap`` (logits become ``cap * tanh(logits / cap)`` after
            scaling, as ``torch_native``) or ``None``.
        causal: bottom-right causal (``False``: every query sees keys ``0 .. seq_len - 1``).
        num_threads: OpenMP threads over the ``(request, KV head)`` pairs; default
            ``torch.get_num_threads()``.

    Returns ``out``. Raises ``ValueError`` naming the first argument whose dtype, device,
    rank or layout the kernel does not take, and ``MetadataError`` (a ``ValueError``)
    naming the first request whose metadata the tensors cannot hold — a request index
    outside the tables, ``query_start_loc`` negative, decreasing or past ``num_tokens``, a
    ``seq_len`` negative or shorter than its query, more block-table columns than the table
    has, a block id in a column the request reads outside ``kv_cache`` (``-1`` padding past
    the columns read is fine) — checked in C before anything is read or written; and
    ``ValueError`` for a ``sliding_window`` below 1 or a ``logits_soft_cap`` not above 0.

    The C code runs without the GIL (other Python threads go on): no other thread may
    resize, free or write these tensors during the call.
    """
    check_call(out, query, kv_cache, block_table, query_start_loc, seq_lens, reqs, sliding_window=sliding_window,
               causal=causal, logits_soft_cap=logits_soft_cap)
    return paged_attention_checked(out, query, kv_cache, block_table, query_start_loc, seq_lens, reqs, scale=scale,
                                   sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, causal=causal,
                                   num_threads=num_threads)


def paged_attention_checked(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, reqs: torch.Tensor, *,
                            scale: float, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                            causal: bool = True, num_threads: int | None = None) -> torch.Tensor:
    """:func:`paged_attention` without its Python checks of dtypes, devices, ranks and layouts:
    for a caller that ran :func:`check_call` on tensors of the same dtypes, shapes and
    strides (``cpu_sdpa``'s impl does once per step and layer geometry: the checks cost
    ~10 µs a call, docs/performance.md). The metadata's values are still checked in C
    before anything is read or written (``MetadataError`` as :func:`paged_attention`).
    Arguments and result: :func:`paged_attention`'s."""
    num_tokens, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    st = kv_cache.stride()
    problem = _paged.paged_attention(
        out.data_ptr(), out.stride(0), out.stride(1), query.data_ptr(), query.stride(0), query.stride(1),
        kv_cache.data_ptr(), st[0], st[1], st[2], st[3], block_table.data_ptr(), block_table.stride(0),
        query_start_loc.data_ptr(), seq_lens.data_ptr(), reqs.data_ptr(), reqs.shape[0], num_heads, num_kv_heads,
        head_size, block_size, float(scale), _window(sliding_window), float(logits_soft_cap or 0.0), bool(causal),
        _DTYPE_CODES[query.dtype], int(num_threads or torch.get_num_threads()), num_tokens,
        query_start_loc.shape[0], seq_lens.shape[0], block_table.shape[0], block_table.shape[1], kv_cache.shape[0])
    if problem is not None:
        raise MetadataError(f"paged_attention: {problem}; nothing was read or written")
    return out


def check_metadata(num_tokens: int, kv_cache: torch.Tensor, block_table: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, reqs: torch.Tensor, *,
                   sliding_window: int | None = None, causal: bool = True) -> None:
    """:func:`paged_attention`'s check of the metadata against ``num_tokens`` query rows and
    ``kv_cache``'s blocks, alone (nothing read from the cache): for a caller that writes the
    cache first and must refuse bad metadata before that write. Arguments as
    :func:`paged_attention`'s (the index tensors' dtypes and layout are assumed, not
    checked: the builder's ``_kernel_layout``). Raises ``MetadataError`` as it does."""
    if kv_cache.dim() != 5 or kv_cache.shape[2] < 1:
        raise MetadataError(f"paged_attention: kv_cache {tuple(kv_cache.shape)} is not "
                            "[num_blocks, 2, block_size >= 1, num_kv_heads, head_size]")
    problem = _paged.check_metadata(
        block_table.data_ptr(), block_table.stride(0), query_start_loc.data_ptr(), seq_lens.data_ptr(),
        reqs.data_ptr(), reqs.shape[0], kv_cache.shape[2], _window(sliding_window), bool(causal), num_tokens,
        query_start_loc.shape[0], seq_lens.shape[0], block_table.shape[0], block_table.shape[1], kv_cache.shape[0])
    if problem is not None:
        raise MetadataError(f"paged_attention: {problem}; nothing was read or written")


def _window(sliding_window: int | None) -> int:
    """The kernel's C ``int`` window: 0 for none; one past any int32 context is no limit."""
    return min(int(sliding_window or 0), 2 ** 31 - 1)


def check_call(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, reqs: torch.Tensor, *,
               sliding_window: int | None = None, causal: bool = True, logits_soft_cap: float | None = None) -> None:
    """:func:`paged_attention`'s checks of everything but the metadata's values (those run
    in C on every call): the kernel takes the dtypes, head size and window
    (:func:`unsupported`), the tensors' ranks, shapes, devices and layouts, the index
    tensors' dtypes. Arguments: :func:`paged_attention`'s. Raises ``ValueError`` as it does."""
    reason = unsupported(query.dtype, kv_cache.dtype, query.shape[-1] if query.dim() == 3 else 0, causal,
                         sliding_window)
    if reason is not None:
        raise ValueError(f"paged_attention: {reason}")
    if query.dim() != 3 or out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"paged_attention: query {tuple(query.shape)} / out {tuple(out.shape)} {out.dtype}: "
                         "both [num_tokens, num_heads, head_size] in one dtype")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[4] != query.shape[2] \
            or min(kv_cache.shape[2], kv_cache.shape[3]) < 1:
        raise ValueError(f"paged_attention: kv_cache {tuple(kv_cache.shape)} is not "
                         f"[num_blocks, 2, block_size >= 1, num_kv_heads >= 1, {query.shape[2]}]")
    if (sliding_window is not None and sliding_window < 1) or (logits_soft_cap is not None and not logits_soft_cap > 0):
        raise ValueError(f"paged_attention: sliding_window {sliding_window!r} / logits_soft_cap {logits_soft_cap!r}: "
                         "None, or a window >= 1 token and a cap > 0")
    if query.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"paged_attention: {query.shape[1]} query heads over {kv_cache.shape[3]} KV heads")
    for name, t in (("out", out), ("query", query), ("kv_cache", kv_cache), ("block_table", block_table)):
        if t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"paged_attention: {name} must be a CPU tensor with a contiguous last dim")
    for name, t, dt, dim in (("block_table", block_table, torch.int32, 2), ("query_start_loc", query_start_loc,
                             torch.int32, 1), ("seq_lens", seq_lens, torch.int32, 1), ("reqs", reqs, torch.int64, 1)):
        if t.dtype != dt or t.dim() != dim or t.device.type != "cpu" or (dim == 1 and not t.is_contiguous()):
            raise ValueError(f"paged_attention: {name} must be a {dim}-d {dt} CPU tensor"
                             + (", contiguous" if dim == 1 else "") + f" (got {t.dtype}, {tuple(t.shape)})")


__all__ = ["ENV_SWITCH", "HEAD_SIZE_MULTIPLE", "available", "check_call", "check_metadata", "paged_attention",
           "paged_attention_checked", "unsupported"]
