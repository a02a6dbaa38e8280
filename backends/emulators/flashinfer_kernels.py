"""A CPU emulator of FlashInfer's paged-KV wrappers' contract (a test tool).

``BatchDecodeWithPagedKVCacheWrapper`` and ``BatchPrefillWithPagedKVCacheWrapper`` with
FlashInfer's ``plan()``/``run()`` split: ``plan()`` takes the step's int32 page metadata
and the attention parameters, ``run()`` takes the query and the cache. Attention is
computed from those arguments only:

* request ``i`` owns pages ``indices[indptr[i] : indptr[i+1]]`` and has
  ``page_size * (num_pages - 1) + last_page_len[i]`` keys (0 with no pages), with
  ``1 <= last_page_len <= page_size``;
* prefill: request ``i``'s queries are rows ``qo_indptr[i] : qo_indptr[i+1]``; query ``j``
  of ``qo_len`` sits at position ``p = kv_len - qo_len + j`` and (``causal``) sees keys
  ``<= p``; decode: one query per request at ``p = kv_len - 1``, seeing keys ``<= p``;
* ``window_left >= 0`` also requires keys ``>= p - window_left`` (inclusive);
* logits are ``sm_scale * q . k``, then ``logits_soft_cap * tanh(logits / cap)`` if a cap
  is set; a query that sees no key outputs zeros;
* ``run(..., sinks=)``: ``[num_qo_heads]`` float32 sink logits, one more term
  ``exp(sinks[h])`` in head ``h``'s softmax denominator (after scale and cap), no value.

Cache layouts: ``"NHD"`` ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` or
``"HND"`` ``[num_pages, 2, num_kv_heads, page_size, head_dim]``, or a ``(k, v)`` tuple.
With ``use_cuda_graph=True`` the wrappers keep the caller's fixed buffers and ``plan()``
copies into them (the batch size is then fixed), as FlashInfer's CUDA-graph mode does.
Preconditions are checked (dtypes, shapes, ``last_page_len`` range, ``run()`` before
``plan()``, heads and dtypes matching the plan, ``out``'s dtype and device, the CUDA-core
decode kernel's group sizes). The wrappers take flashinfer-python 0.6.18's parameter
names exactly (no catch-all ``**kwargs``), so a misspelt or misplaced keyword fails here as
on a GPU. ``return_lse`` gives FlashInfer's base-2 log-sum-exp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from attnplug.backends.common.sinks import fold_sinks
from attnplug.backends.emulators.reference import attend_ranges, gather_pages


class FlashInferContractError(ValueError):
    """The arguments break FlashInfer's documented contract."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise FlashInferContractError(what)


def _int32_1d(name: str, t) -> None:
    _require(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1,
             f"{name} must be a 1-D int32 tensor, got {getattr(t, 'dtype', type(t))} "
             f"{tuple(getattr(t, 'shape', ()))}")


@dataclass
class _Plan:
    qo_indptr: list[int] | None
    indptr: list[int]
    indices: torch.Tensor
    last_page_len: list[int]
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    causal: bool
    window_left: int
    logits_soft_cap: float
    sm_scale: float
    q_data_type: torch.dtype
    kv_data_type: torch.dtype
    o_data_type: torch.dtype


def _dtype(d, default: torch.dtype) -> torch.dtype:
    if d is None:
        return default
    return getattr(torch, d) if isinstance(d, str) else d


class _Wrapper:
    _decode = False

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 indptr_buf=None, indices_buf=None, last_page_len_buf=None, qo_indptr_buf=None):
        _require(kv_layout in ("NHD", "HND"), f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        _require(isinstance(float_workspace_buffer, torch.Tensor), "float_workspace_buffer must be a tensor")
        self.kv_layout = kv_layout
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            for name, buf in (("paged_kv_indptr_buffer", indptr_buf), ("paged_kv_indices_buffer", indices_buf),
                              ("paged_kv_last_page_len_buffer", last_page_len_buf)):
                _int32_1d(name, buf)
            _require(indptr_buf.shape[0] == last_page_len_buf.shape[0] + 1,
                     "The size of paged_kv_indptr_buffer should be batch_size + 1")
            if qo_indptr_buf is not None:
                _int32_1d("qo_indptr_buf", qo_indptr_buf)
        self._bufs = SimpleNamespace(indptr=indptr_buf, indices=indices_buf, last_page_len=last_page_len_buf,
                                     qo_indptr=qo_indptr_buf)
        self._plan: _Plan | None = None
        self.num_plans = 0

    def _store(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
               causal, window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type, o_data_type=None) -> None:
        for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
            _int32_1d(name, t)
        B = last_page_len.shape[0]
        _require(indptr.shape[0] == B + 1, f"indptr has {indptr.shape[0]} entries for a batch of {B}")
        ptr, last = indptr.tolist(), last_page_len.tolist()
        _require(ptr[0] == 0 and all(a <= b for a, b in zip(ptr, ptr[1:])) and ptr[-1] <= indices.shape[0],
                 f"indptr {ptr} must start at 0, be non-decreasing and end <= len(indices) {indices.shape[0]}")
        _require(page_size > 0 and all(1 <= x <= page_size for x, a, b in zip(last, ptr, ptr[1:]) if b > a),
                 f"last_page_len {last} must lie in 1..page_size={page_size} for requests with pages")
        _require(num_qo_heads % num_kv_heads == 0, f"num_qo_heads {num_qo_heads} % num_kv_heads {num_kv_heads} != 0")
        _require(isinstance(window_left, int) and window_left >= -1, f"window_left must be an int >= -1, got "
                                                                      f"{window_left!r}")
        qo = None
        if qo_indptr is not None:
            _int32_1d("qo_indptr", qo_indptr)
            qo = qo_indptr.tolist()
            _require(len(qo) == B + 1 and qo[0] == 0 and all(a <= b for a, b in zip(qo, qo[1:])),
                     f"qo_indptr {qo} must have batch_size + 1 = {B + 1} non-decreasing entries from 0")
        if self.use_cuda_graph:
            _require(B + 1 == self._bufs.indptr.shape[0], f"The batch size should be fixed in cudagraph mode: plan "
                     f"got {B}, the buffers hold {self._bufs.indptr.shape[0] - 1}")
            _require(ptr[-1] <= self._bufs.indices.shape[0], "indices exceed paged_kv_indices_buffer")
            self._bufs.indptr.copy_(indptr)
            self._bufs.last_page_len.copy_(last_page_len)
            self._bufs.indices[: ptr[-1]].copy_(indices[: ptr[-1]])
            if qo is not None and self._bufs.qo_indptr is not None:
                self._bufs.qo_indptr.copy_(qo_indptr)
        self._plan = _Plan(qo, ptr, indices[: ptr[-1]].clone(), last, int(num_qo_heads), int(num_kv_heads),
                           int(head_dim), int(page_size), bool(causal), int(window_left),
                           float(logits_soft_cap or 0.0), head_dim ** -0.5 if sm_scale is None else float(sm_scale),
                           _dtype(q_data_type, torch.float16), _dtype(kv_data_type, _dtype(q_data_type, torch.float16)),
                           _dtype(o_data_type, _dtype(q_data_type, torch.float16)))
        self.num_plans += 1

    def _run(self, q: torch.Tensor, paged_kv_cache, out: torch.Tensor | None, return_lse: bool,
             sinks: torch.Tensor | None = None, k_scale: float | None = None,
             v_scale: float | None = None):
        """``k_scale`` / ``v_scale``: FlashInfer's per-tensor fp8 calibration scales (python
        floats; ``None`` = 1.0; ``BatchPrefillWithPagedKVCacheWrapper.run`` docs): the kernel
        reads the stored fp8 values, multiplies ``sm_scale`` by ``k_scale`` and the output by
        ``v_scale``. The same as attending over ``stored * scale``, which is what this does."""
        p = self._plan
        _require(p is not None, "run() called before plan()")
        _check_sinks(sinks, q, p.num_qo_heads, return_lse)
        if isinstance(paged_kv_cache, tuple):
            k_cache, v_cache = paged_kv_cache
        else:
            _require(paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2,
                     f"paged_kv_cache must be [num_pages, 2, ...], got {tuple(paged_kv_cache.shape)}")
            k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
        if self.kv_layout == "HND":
            k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        _require(tuple(k_cache.shape[1:]) == (p.page_size, p.num_kv_heads, p.head_dim),
                 f"cache pages {tuple(k_cache.shape[1:])} (as NHD) do not match the plan "
                 f"(page_size {p.page_size}, {p.num_kv_heads} KV heads, head_dim {p.head_dim})")
        _require(q.dtype == p.q_data_type and k_cache.dtype == p.kv_data_type,
                 f"q/kv dtypes {q.dtype}/{k_cache.dtype} differ from the plan's {p.q_data_type}/{p.kv_data_type}")
        B = len(p.last_page_len)
        rows = p.qo_indptr if p.qo_indptr is not None else list(range(B + 1))
        _require(q.dim() == 3 and q.shape[0] == rows[-1] and tuple(q.shape[1:]) == (p.num_qo_heads, p.head_dim),
                 f"q {tuple(q.shape)} must be [{rows[-1]}, {p.num_qo_heads}, {p.head_dim}] for this plan")
        res = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], p.num_qo_heads), float("-inf"), device=q.device)
        for i in range(B):
            n_pages = p.indptr[i + 1] - p.indptr[i]
            kv_len = 0 if n_pages == 0 else p.page_size * (n_pages - 1) + p.last_page_len[i]
            qo_len = rows[i + 1] - rows[i]
            if qo_len == 0:
                continue
            pages = p.indices[p.indptr[i]: p.indptr[i + 1]]
            k, v = gather_pages(k_cache, pages, kv_len), gather_pages(v_cache, pages, kv_len)
            if k_scale is not None or v_scale is not None:
                k, v = k.float() * (1.0 if k_scale is None else k_scale), v.float() * (1.0 if v_scale is None else v_scale)
            pos = torch.arange(qo_len, device=q.device) + kv_len - qo_len
            hi = pos if (p.causal or self._decode) else torch.full_like(pos, kv_len - 1)
            lo = pos - p.window_left if p.window_left >= 0 else torch.zeros_like(pos)
            o, s = attend_ranges(q[rows[i]:rows[i + 1]], k, v, lo, hi, p.sm_scale, p.logits_soft_cap)
            if sinks is not None:  # the sink joins each head's denominator (no value)
                o = fold_sinks(o, s.transpose(0, 1), sinks)
            res[rows[i]:rows[i + 1]] = o
            lse[rows[i]:rows[i + 1]] = s.transpose(0, 1)
        if out is None:
            out = res.to(q.dtype)
        else:
            _require(out.shape == q.shape and out.dtype == p.o_data_type and out.device == q.device,
                     f"out {tuple(out.shape)} {out.dtype} on {out.device} must be q's shape {tuple(q.shape)}, the "
                     f"plan's o_data_type {p.o_data_type} and q's device {q.device}")
            out.copy_(res)
        # FlashInfer's lse is base 2 (prefill.cuh: log2(d) + m), not natural log
        return (out, lse / math.log(2.0)) if return_lse else out


def _check_sinks(sinks, q: torch.Tensor, num_qo_heads: int, return_lse: bool) -> None:
    """``run(sinks=)``: ``None`` or ``[num_qo_heads]`` float32 on ``q``'s device, one sink logit
    per query head, added to the softmax denominator after ``sm_scale`` and the soft-cap."""
    if sinks is None:
        return
    _require(isinstance(sinks, torch.Tensor) and sinks.dtype == torch.float32 and sinks.device == q.device
             and tuple(sinks.shape) == (num_qo_heads,),
             f"sinks must be a [{num_qo_heads}] float32 tensor on {q.device}, got "
             f"{getattr(sinks, 'shape', sinks)!r} {getattr(sinks, 'dtype', '')}")
    _require(not return_lse, "the emulator does not cover return_lse together with sinks")


DECODE_GROUP_SIZES_WITHOUT_TENSOR_CORES = (1, 2, 3, 4, 6, 8)
"""Query heads per KV head FlashInfer's CUDA-core decode kernel takes (``utils.cuh``,
``DISPATCH_GQA_GROUP_SIZE``: "Unsupported group_size" otherwise); tensor cores take any."""


def _scale(value, name: str) -> float | None:
    """A per-tensor fp8 scale as FlashInfer takes it: ``None`` or a python number (a tensor
    would need a host sync inside ``run()``; FlashInfer documents ``Optional[float]``)."""
    _require(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)),
             f"{name} must be a python float (per-tensor), got {type(value).__name__}")
    return None if value is None else float(value)


def _unsupported(**given) -> None:
    """The emulator covers the paths attnplug uses; any other option must stay at its default."""
    defaults = (False, 0, "auto", "NONE", 1, -1)
    used = [name for name, value in given.items()
            if not (value is None or (isinstance(value, (bool, int, str)) and value in defaults))]
    _require(not used, f"the emulator does not cover {', '.join(used)}")


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    """Emulated ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (one query per request).

    Parameter names and kinds are flashinfer-python 0.6.18's (``decode.py``): ``plan()``
    forwards its options to the keyword-only ``_plan_impl``, so an unknown keyword is a
    ``TypeError`` here as there.
    """

    _decode = True

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        _unsupported(jit_args=jit_args)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, paged_kv_indptr_buffer,
                         paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.use_tensor_cores = bool(use_tensor_cores)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, window_right=-1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None, non_blocking=True, block_tables=None, seq_lens=None,
             fixed_split_size=None, disable_split_kv=False, q_len_per_req=1):
        _require(pos_encoding_mode == "NONE", "the emulator covers pos_encoding_mode='NONE' only")
        _unsupported(window_right=window_right, rope_scale=rope_scale, rope_theta=rope_theta,
                     block_tables=block_tables, seq_lens=seq_lens, q_len_per_req=q_len_per_req)
        group = num_qo_heads // max(num_kv_heads, 1)
        _require(self.use_tensor_cores or group in DECODE_GROUP_SIZES_WITHOUT_TENSOR_CORES,
                 f"Unsupported group_size: {group} (num_qo_heads / num_kv_heads) without use_tensor_cores; the "
                 f"CUDA-core decode kernel takes {DECODE_GROUP_SIZES_WITHOUT_TENSOR_CORES}")
        self._store(None, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, False,
                    window_left, logits_soft_cap, sm_scale, q_data_type or data_type, kv_data_type or data_type,
                    o_data_type)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=1,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        _unsupported(positional_options=len(args), q_scale=q_scale, lse=lse,
                     window_left=window_left, q_len_per_req=q_len_per_req,
                     skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor, kv_cache_sf=kv_cache_sf)
        return self._run(q, paged_kv_cache, out, return_lse, sinks, _scale(k_scale, "k_scale"), _scale(v_scale, "v_scale"))


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    """Emulated ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` (varlen queries).

    Parameter names and order are flashinfer-python 0.6.18's (``prefill.py``); CUDA-graph
    mode needs ``qo_indptr_buf`` as there.
    """

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
        _unsupported(custom_mask_buf=custom_mask_buf, mask_indptr_buf=mask_indptr_buf, jit_args=jit_args,
                     jit_kwargs=jit_kwargs)
        _require(not use_cuda_graph or qo_indptr_buf is not None, "CUDA-graph prefill needs qo_indptr_buf")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, paged_kv_indptr_buf,
                         paged_kv_indices_buf, paged_kv_last_page_len_buf, qo_indptr_buf)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False):
        _require(custom_mask is None and packed_custom_mask is None and pos_encoding_mode == "NONE"
                 and head_dim_vo in (None, head_dim_qk), "the emulator covers causal/full masks without RoPE only")
        _unsupported(use_fp16_qk_reduction=use_fp16_qk_reduction, rope_scale=rope_scale, rope_theta=rope_theta,
                     prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
                     token_pos_in_items_len=token_pos_in_items_len, max_item_len_ptr=max_item_len_ptr,
                     seq_lens=seq_lens, seq_lens_q=seq_lens_q, block_tables=block_tables)
        self._store(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                    head_dim_qk, page_size, causal, window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type,
                    o_data_type)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor=None, use_fp16_softmax=False, uses_spcompress=False):
        _unsupported(positional_options=len(args), q_scale=q_scale, lse=lse,
                     window_left=window_left, kv_cache_sf=kv_cache_sf,
                     skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                     use_fp16_softmax=use_fp16_softmax, uses_spcompress=uses_spcompress)
        return self._run(q, paged_kv_cache, out, return_lse, sinks, _scale(k_scale, "k_scale"), _scale(v_scale, "v_scale"))


EMULATED_FLASHINFER = SimpleNamespace(
    BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
    __version__="emulated",
)
"""A stand-in for the ``flashinfer`` module (what the flashinfer builder asks for)."""
