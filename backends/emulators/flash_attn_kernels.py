"""A CPU emulator of the FlashAttention paged varlen kernels' contract (a test tool).

It computes attention from the kernel's own arguments and nothing else, so running the
``flash_attn`` builder's real output through it checks the lowering without a GPU:

* FlashAttention 2 ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
  alibi_slopes, deterministic, return_attn_probs, block_table)`` — paged: ``k``/``v`` are
  ``[num_blocks, page_block_size, nheads_k, headdim]`` with ``page_block_size % 256 ==
  0``; request ``i`` has ``cu_seqlens_k[i+1] - cu_seqlens_k[i]`` keys.
* FlashAttention 3 ``flash_attn_with_kvcache(q, k_cache, v_cache, ..., cache_seqlens,
  page_table, cu_seqlens_q, max_seqlen_q, softmax_scale, causal, window_size, softcap,
  scheduler_metadata, num_splits, return_softmax_lse)`` — any page size; request ``i``
  has ``cache_seqlens[i]`` keys. ``get_scheduler_metadata`` returns an opaque int32 tensor.

Conventions (FlashAttention's docstrings): causal is bottom-right aligned; with
``window_size=(left, right)`` query ``i`` of a sequence with ``Lq`` queries and ``Lk``
keys sees keys ``[i + Lk - Lq - left, i + Lk - Lq + right]`` inclusive (``-1`` =
unbounded; causal forces ``right = 0``); a query row that sees no key outputs zeros.
``softmax_lse`` is ``[nheads, total_q]``, natural log, ``+inf`` for a row that saw no key
(what the real non-split kernels write). Output rows of tokens outside
every sequence (padding) are zeros here (the real kernels leave them unspecified).

Preconditions the real kernels rely on are *checked* (int32 metadata, shapes, page size,
``max_seqlen_*`` bounds, block-table coverage), so a lowering that only works by luck
fails here. The emulator may synchronise with the host; it is not for production.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from attnplug.backends.emulators.reference import attend_ranges, gather_pages
from attnplug.backends.flash_attn.kernels import FA2_PAGE_SIZE_MULTIPLE, FlashAttnKernels


class FlashAttnContractError(ValueError):
    """The arguments break FlashAttention's documented contract (the real kernel would fail
    or compute garbage)."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise FlashAttnContractError(what)


def _int32(name: str, t: torch.Tensor | None, dims: int) -> None:
    _require(t is not None and t.dtype == torch.int32 and t.dim() == dims,
             f"{name} must be an int32 tensor with {dims} dim(s), got "
             f"{None if t is None else (t.dtype, tuple(t.shape))}")


def paged_varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           kv_lens: torch.Tensor, block_table: torch.Tensor, max_seqlen_q: int,
                           max_seqlen_k: int | None,
                           softmax_scale: float | None, causal: bool, window_size, softcap: float,
                           page_multiple: int = 1, descale: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The common contract of both versions; returns ``(out, softmax_lse)``.

    ``descale``: FA3's fp8 ``(q_descale, k_descale, v_descale)``, each ``[batch_size,
    num_heads_k]`` float32 or ``None`` (1.0) (``hopper/flash_attn_interface.py``): q, k and v
    are ``float8_e4m3fn``; the real values are ``stored * descale`` of the request and KV
    head (a query head reads its KV head's), and the output is bfloat16."""
    _require(q.dim() == 3, f"q must be [total_q, nheads, headdim], got {tuple(q.shape)}")
    _require(k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
             f"paged k/v must be [num_blocks, page_block_size, nheads_k, headdim], got {tuple(k_cache.shape)} / "
             f"{tuple(v_cache.shape)}")
    _require(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "k/v caches need a contiguous last dimension")
    num_heads, head_size = q.shape[1:]
    page = k_cache.shape[1]
    _require(k_cache.shape[3] == head_size and num_heads % k_cache.shape[2] == 0,
             f"q heads/headdim {tuple(q.shape[1:])} do not fit k_cache {tuple(k_cache.shape)} (GQA needs "
             "nheads % nheads_k == 0)")
    _require(page % page_multiple == 0, f"page_block_size {page} must be a multiple of {page_multiple}")
    _require(q.dtype == k_cache.dtype == v_cache.dtype, f"q/k/v dtypes differ: {q.dtype}, {k_cache.dtype}")
    fp8 = q.dtype == torch.float8_e4m3fn
    _require(fp8 or descale is None or all(d is None for d in descale),
             "q_descale / k_descale / v_descale are for float8_e4m3fn q / k / v only")
    _require(q.dtype not in (torch.float8_e5m2,), "FA3 fp8 takes float8_e4m3fn only")
    _int32("cu_seqlens_q", cu_seqlens_q, 1)
    _int32("kv lengths", kv_lens, 1)
    _int32("block_table", block_table, 2)
    B = cu_seqlens_q.shape[0] - 1
    _require(kv_lens.shape[0] == B and block_table.shape[0] == B,
             f"batch sizes disagree: cu_seqlens_q says {B}, kv lengths {kv_lens.shape[0]}, block_table "
             f"{block_table.shape[0]}")
    _require(len(window_size) == 2 and all(isinstance(w, int) and w >= -1 for w in window_size),
             f"window_size must be (left, right) ints >= -1, got {window_size!r}")
    cu = cu_seqlens_q.tolist()
    lens = kv_lens.tolist()
    _require(cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])) and cu[-1] <= q.shape[0],
             f"cu_seqlens_q {cu} must start at 0, be non-decreasing and end <= total_q {q.shape[0]}")
    q_lens = [b - a for a, b in zip(cu, cu[1:])]
    _require(max(q_lens, default=0) <= max_seqlen_q, f"max_seqlen_q={max_seqlen_q} < a query length {max(q_lens)}")
    if max_seqlen_k is not None:
        _require(max(lens, default=0) <= max_seqlen_k, f"max_seqlen_k={max_seqlen_k} < a key length {max(lens)}")
    _require(min(lens, default=0) >= 0 and max(lens, default=0) <= block_table.shape[1] * page,
             f"key lengths {lens} exceed the block table's {block_table.shape[1]} pages of {page}")
    scale = head_size ** -0.5 if softmax_scale is None else float(softmax_scale)
    left, right = window_size
    if causal:
        right = 0
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((num_heads, q.shape[0]), float("-inf"), device=q.device)
    for i in range(B):
        lq, lk = q_lens[i], lens[i]
        if lq == 0:
            continue
        pages = block_table[i]
        used = pages[: -(-lk // page)]
        _require(bool(((used >= 0) & (used < k_cache.shape[0])).all()),
                 f"block_table row {i} points outside the cache ({k_cache.shape[0]} blocks): {used.tolist()}")
        k = gather_pages(k_cache, pages, lk)
        v = gather_pages(v_cache, pages, lk)
        qi = q[cu[i]:cu[i + 1]]
        if fp8:  # the kernel's fp32 math on stored * descale (same as scaling the logits / output)
            for name, d in zip("qkv", descale or (None, None, None)):
                _require(d is None or tuple(d.shape) == (B, k_cache.shape[2]),
                         f"{name}_descale must be [batch_size, num_heads_k] = [{B}, {k_cache.shape[2]}], got "
                         f"{None if d is None else tuple(d.shape)}")
            qi, k, v = (_descaled(t, d, i, num_heads // k_cache.shape[2] if name == "q" else 1)
                        for name, t, d in zip("qkv", (qi, k, v), descale or (None, None, None)))
        at = torch.arange(lq, device=q.device) + lk - lq  # i + Lk - Lq
        lo = at - left if left >= 0 else torch.zeros_like(at)
        hi = at + right if right >= 0 else torch.full_like(at, lk - 1)
        o, s = attend_ranges(qi, k, v, lo, hi.clamp(max=lk - 1), scale, softcap)
        out[cu[i]:cu[i + 1]] = o
        lse[:, cu[i]:cu[i + 1]] = s
    # a row that saw no key: FlashAttention's non-split kernels write +inf (softmax.h), not -inf
    return out.to(torch.bfloat16 if fp8 else q.dtype), torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def _descaled(t: torch.Tensor, descale: torch.Tensor | None, batch: int, group: int) -> torch.Tensor:
    """``t`` (``[tokens, heads, headdim]`` fp8) as float32 times its request's descale row
    (``[batch_size, num_heads_k]``; query heads repeat their KV head's ``group`` times)."""
    t = t.float()
    if descale is None:
        return t
    _require(descale.dim() == 2 and descale.dtype == torch.float32,
             f"descale must be float32 [batch_size, num_heads_k], got {descale.dtype} {tuple(descale.shape)}")
    return t * descale[batch].repeat_interleave(group).view(1, -1, 1)


def fa3_plan(batch_size: int, max_seqlen_q: int, seqlen_k: int, num_heads_q: int, num_heads_kv: int,
             headdim: int, page_size: int | None, causal: bool, window_size: tuple[int, int],
             has_softcap: bool) -> tuple[tuple, int]:
    """What an FA3 schedule is planned for, and the scheduler metadata's length.

    FA3 plans (``get_scheduler_metadata``) and runs (``mha_fwd``) from the same normalised
    arguments: a left window reaching past ``seqlen_k - 1`` keys is no window, causal forces
    ``right = 0``, and a remaining window makes the call local rather than causal. The
    metadata holds ``1 + round_up(batch, 4) * (2 + !local + (causal || local))`` int32
    entries (newer FA3 requires that exact length). ``flash_attn_with_kvcache`` takes no
    ``max_seqlen_k``: its ``seqlen_k`` is ``page_table.shape[1] * page_size``.
    """
    left, right = window_size
    if causal:
        right = 0
    if left >= seqlen_k - 1:
        left = -1
    local = left >= 0 or (right >= 0 and not causal)
    is_causal = causal and not local
    length = 1 + -(-batch_size // 4) * 4 * (2 + (not local) + (is_causal or local))
    plan = (batch_size, max_seqlen_q, seqlen_k, num_heads_q, num_heads_kv, headdim, page_size, is_causal, local,
            left, right, has_softcap)
    return plan, length


@dataclass
class FlashAttnEmulator:
    """Emulated entry points of one FlashAttention version, with a call log.

    Attributes:
        version: 2 or 3 (which entry points :meth:`kernels` exposes).
        calls: ``(entry point name, kwargs)`` of every call, newest last (tests inspect it).
    """

    version: int = 3
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    _plans: dict[int, tuple] = field(default_factory=dict, repr=False)

    def kernels(self) -> FlashAttnKernels:
        """These entry points as :class:`~attnplug.backends.flash_attn.kernels.FlashAttnKernels`."""
        if self.version == 3:
            return FlashAttnKernels(3, "emulated FlashAttention 3", with_kvcache=self.flash_attn_with_kvcache,
                                    get_scheduler_metadata=self.get_scheduler_metadata, emulated=True)
        return FlashAttnKernels(2, "emulated FlashAttention 2", varlen_func=self.flash_attn_varlen_func,
                                emulated=True)

    def _log(self, name: str, **kwargs) -> None:
        self.calls.append((name, kwargs))
        del self.calls[:-64]

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        """FA2's signature; paged K/V only (``block_table`` required)."""
        self._log("flash_attn_varlen_func", cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                  window_size=window_size, softcap=softcap, block_table=block_table)
        _require(block_table is not None, "the emulator covers paged K/V only: pass block_table")
        _require(dropout_p == 0.0 and alibi_slopes is None, "inference only: dropout_p=0 and no alibi")
        _int32("cu_seqlens_k", cu_seqlens_k, 1)
        _require(cu_seqlens_k.shape == cu_seqlens_q.shape and int(cu_seqlens_k[0]) == 0,
                 f"cu_seqlens_k {tuple(cu_seqlens_k.shape)} must match cu_seqlens_q and start at 0")
        kv_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        # FA2's mha_varlen_fwd (csrc/flash_attn/flash_api.cpp): single-query GQA batches without
        # a window are run as one fixed-length batch, q viewed as [batch, nheads_k, groups, d]
        # ("seqlenq_ngroups_swapped"; causal is moot at one query): q needs exactly one row
        # per request, and row i is request i's query whatever cu_seqlens_q says.
        left, right = window_size
        swapped = (max_seqlen_q == 1 and q.shape[1] > k.shape[2] and q.shape[2] % 8 == 0
                   and left < 0 and right < 0)
        if swapped:
            B = cu_seqlens_q.shape[0] - 1
            _require(q.shape[0] == B, f"max_seqlen_q == 1 with GQA: FA2 views q as [batch, ...], so q needs exactly "
                                      f"batch_size = {B} rows, got {q.shape[0]}")
            _int32("cu_seqlens_q", cu_seqlens_q, 1)
            cu_seqlens_q = torch.arange(B + 1, dtype=torch.int32, device=q.device)  # the kernel drops it
        out, lse = paged_varlen_attention(q, k, v, cu_seqlens_q, kv_lens, block_table, max_seqlen_q, max_seqlen_k,
                                          softmax_scale, causal, tuple(window_size), float(softcap or 0.0),
                                          page_multiple=FA2_PAGE_SIZE_MULTIPLE)
        return (out, lse, None) if return_attn_probs else out

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                                return_softmax_lse=False):
        """FA3's signature; varlen queries (``cu_seqlens_q``) over a paged cache (``page_table``)."""
        self._log("flash_attn_with_kvcache", cache_seqlens=cache_seqlens, page_table=page_table,
                  cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, causal=causal,
                  window_size=window_size, softcap=softcap, scheduler_metadata=scheduler_metadata)
        _require(k is None and v is None and qv is None and rotary_cos is None and cache_batch_idx is None
                 and cache_leftpad is None, "the emulator covers attention over the cache only (no in-kernel "
                 "append, rotary, batch index or left padding)")
        _require(page_table is not None and cu_seqlens_q is not None and max_seqlen_q is not None,
                 "varlen paged use needs page_table, cu_seqlens_q and max_seqlen_q")
        _int32("cache_seqlens", cache_seqlens, 1)
        if scheduler_metadata is not None:
            _int32("scheduler_metadata", scheduler_metadata, 1)
            plan, length = fa3_plan(cache_seqlens.shape[0], max_seqlen_q, page_table.shape[1] * k_cache.shape[1],
                                    q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], causal,
                                    tuple(window_size), float(softcap or 0.0) > 0)
            planned = self._plans.get(int(scheduler_metadata[0]))
            _require(scheduler_metadata.shape[0] == length and planned == plan,
                     f"scheduler_metadata [{scheduler_metadata.shape[0]}] was planned for {planned}, but this call "
                     f"runs {plan} (needs [{length}] entries): get_scheduler_metadata must get the arguments the "
                     "attention call derives (max_seqlen_k = page_table.shape[1] * page_size, as "
                     "flash_attn_with_kvcache passes none)")
        out, lse = paged_varlen_attention(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table, max_seqlen_q,
                                          None, softmax_scale, causal, tuple(window_size), float(softcap or 0.0),
                                          descale=(q_descale, k_descale, v_descale))
        return (out, lse, None) if return_softmax_lse else out  # upstream: (out, softmax_lse, *rest)

    def get_scheduler_metadata(self, batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                               cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                               cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                               causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False, num_splits=0,
                               pack_gqa=None, sm_margin=0):
        """FA3's signature; checks the arguments and returns an int32 tensor of the length
        FA3 gives the plan (:func:`fa3_plan`) whose entry 0 names the plan, so that
        ``flash_attn_with_kvcache`` can check it was planned for the call it serves."""
        self._log("get_scheduler_metadata", batch_size=batch_size, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_seqlen_k, num_heads_q=num_heads_q, num_heads_kv=num_heads_kv, headdim=headdim,
                  cache_seqlens=cache_seqlens, cu_seqlens_q=cu_seqlens_q, page_size=page_size, causal=causal,
                  window_size=window_size, has_softcap=has_softcap)
        _int32("cache_seqlens", cache_seqlens, 1)
        _require(cache_seqlens.shape[0] == batch_size and num_heads_q % num_heads_kv == 0,
                 f"batch_size {batch_size} / cache_seqlens {tuple(cache_seqlens.shape)} / heads "
                 f"{num_heads_q}/{num_heads_kv} disagree")
        if cu_seqlens_q is not None:
            _int32("cu_seqlens_q", cu_seqlens_q, 1)
            _require(cu_seqlens_q.shape[0] == batch_size + 1, "cu_seqlens_q must have batch_size + 1 entries")
        plan, length = fa3_plan(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                                page_size, causal, tuple(window_size), bool(has_softcap))
        tag = hash(plan) & 0x7FFFFFFF
        self._plans[tag] = plan
        sched = torch.zeros(length, dtype=torch.int32, device=cache_seqlens.device)
        sched[0] = tag
        return sched
