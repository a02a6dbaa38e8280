"""CPU emulators of the MLA decode kernels' documented contracts (test tools).

**FlashMLA** (``flash_mla``, the DeepSeek kernel; signatures of its
``flash_mla_interface.py``):

* ``get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k)`` ->
  ``(tile_scheduler_metadata [num_sm_parts, 8] int32, num_splits [batch + 1] int32)``;
  ``num_heads_per_head_k = seq_len_q * num_heads_q // num_heads_k``.
* ``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
  tile_scheduler_metadata, num_splits, softmax_scale=None, causal=False)`` ->
  ``(out [batch, seq_len_q, num_heads_q, head_dim_v], softmax_lse [batch, num_heads_q,
  seq_len_q] float32)``; ``q`` ``[batch, seq_len_q, num_heads_q, head_dim]``, ``k_cache``
  ``[num_blocks, 64, num_heads_k, head_dim]`` (page block size 64), values are the first
  ``head_dim_v`` features of the keys; the LSE is natural-log (FlashAttention's
  convention), ``+inf`` for a row that saw no key; scale default ``head_dim ** -0.5``.

**FlashInfer MLA** (``flashinfer.mla.BatchMLAPagedAttentionWrapper``, flashinfer-python
0.6.18's parameter names):

* ``Wrapper(float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
  kv_indices=None, kv_len_arr=None, backend="auto")``;
* ``plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
  head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type,
  use_profiler=False)``: request ``i`` owns pages ``kv_indices[kv_indptr[i]:
  kv_indptr[i+1]]`` and has ``kv_len_arr[i]`` keys;
* ``run(q_nope [n, H, ckv], q_pe [n, H, kpe], ckv_cache [pages, page_size, ckv],
  kpe_cache [pages, page_size, kpe], out=None, lse=None, return_lse=False,
  profiler_buffer=None, kv_len=None, page_table=None, return_lse_base_on_e=False)`` ->
  ``out [n, H, ckv]`` (and ``lse [n, H]``, base 2 unless ``return_lse_base_on_e``).

Every precondition the documents state is checked and raises :class:`MLAContractError`;
float32 is accepted too (the emulators are wider than the kernels, so the conformance
cases exercise the lowering). Attention is computed from the arguments only.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

FLASH_MLA_PAGE_BLOCK_SIZE = 64
TILE_SCHEDULER_METADATA_SIZE = 8
NUM_SM_PARTS = 4
"""The emulated GPU's SM partitions (rows of ``tile_scheduler_metadata``)."""


class MLAContractError(ValueError):
    """The arguments break the emulated kernel's documented contract."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise MLAContractError(what)


def _int32(name: str, t, dim: int = 1) -> None:
    _require(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == dim,
             f"{name} must be a {dim}-D torch.int32 tensor, got "
             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal: bool):
    """``q`` ``[s_q, H, D]`` over ``keys`` ``[S, D]`` / ``values`` ``[S, Dv]`` (one KV head):
    ``(out [s_q, H, Dv], lse [H, s_q])`` natural log, ``-inf`` with no key."""
    s_q, s = q.shape[0], keys.shape[0]
    logits = torch.einsum("qhd,sd->hqs", q.double(), keys.double()) * scale
    if causal and s_q > 1:
        pos = s - s_q + torch.arange(s_q)
        logits = logits.masked_fill(torch.arange(s).unsqueeze(0) > pos.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, -1) if s else torch.full((q.shape[1], s_q), float("-inf"), dtype=torch.float64)
    p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1)) if s else logits
    out = torch.einsum("hqs,sv->qhv", p, values.double()) if s else q.new_zeros(s_q, q.shape[1], values.shape[1])
    return out, lse


# --- FlashMLA ---------------------------------------------------------------------------
class FlashMLAEmulator:
    """``get_mla_metadata`` / ``flash_mla_with_kvcache`` with a call log (``calls``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def get_mla_metadata(self, cache_seqlens: torch.Tensor, num_heads_per_head_k: int,
                         num_heads_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        _int32("cache_seqlens", cache_seqlens)
        _require(isinstance(num_heads_per_head_k, int) and num_heads_per_head_k > 0,
                 f"num_heads_per_head_k must be a positive int, got {num_heads_per_head_k!r}")
        _require(num_heads_k == 1, f"FlashMLA serves MLA: num_heads_k must be 1, got {num_heads_k!r}")
        seq = cache_seqlens.cpu().long()
        blocks = (seq + FLASH_MLA_PAGE_BLOCK_SIZE - 1) // FLASH_MLA_PAGE_BLOCK_SIZE
        splits = torch.clamp(blocks * NUM_SM_PARTS // max(int(blocks.sum()), 1), min=1)
        num_splits = torch.zeros(len(seq) + 1, dtype=torch.int32)
        num_splits[1:] = torch.cumsum(splits, 0).to(torch.int32)
        meta = torch.zeros(NUM_SM_PARTS, TILE_SCHEDULER_METADATA_SIZE, dtype=torch.int32)
        meta[:, 0] = torch.arange(NUM_SM_PARTS) * len(seq) // NUM_SM_PARTS
        # the emulated plan remembers what it was made for, so a run with other seqlens
        # or heads (a stale plan) is caught: columns 5..7 are unused by the real layout
        meta[:, 5], meta[:, 6], meta[:, 7] = int(blocks.sum()), num_heads_per_head_k, len(seq)
        self.calls.append(("get_mla_metadata", {"cache_seqlens": seq.clone(),
                                                "num_heads_per_head_k": num_heads_per_head_k}))
        return meta.to(cache_seqlens.device), num_splits.to(cache_seqlens.device)

    def flash_mla_with_kvcache(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                               cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: torch.Tensor,
                               num_splits: torch.Tensor, softmax_scale: float | None = None,
                               causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        _require(q.dim() == 4 and k_cache.dim() == 4, f"q {tuple(q.shape)} must be [batch, seq_len_q, heads_q, "
                 f"head_dim] and k_cache {tuple(k_cache.shape)} [num_blocks, page_block_size, heads_k, head_dim]")
        b, s_q, h_q, d = q.shape
        _require(k_cache.shape[1] == FLASH_MLA_PAGE_BLOCK_SIZE,
                 f"k_cache page_block_size must be {FLASH_MLA_PAGE_BLOCK_SIZE}, got {k_cache.shape[1]}")
        _require(k_cache.shape[2] == 1 and k_cache.shape[3] == d,
                 f"k_cache {tuple(k_cache.shape)} must have one KV head of head_dim {d}")
        _require(q.dtype == k_cache.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32),
                 f"q {q.dtype} and k_cache {k_cache.dtype} must share a float dtype")
        _int32("block_table", block_table, 2)
        _int32("cache_seqlens", cache_seqlens)
        _require(block_table.shape[0] == b and cache_seqlens.shape[0] == b,
                 f"block_table rows {block_table.shape[0]} and cache_seqlens {cache_seqlens.shape[0]} must be batch {b}")
        _require(0 < head_dim_v <= d, f"head_dim_v {head_dim_v} must be in (0, head_dim {d}]")
        _int32("tile_scheduler_metadata", tile_scheduler_metadata, 2)
        _int32("num_splits", num_splits)
        _require(tile_scheduler_metadata.shape[1] == TILE_SCHEDULER_METADATA_SIZE and num_splits.shape[0] == b + 1,
                 f"tile_scheduler_metadata {tuple(tile_scheduler_metadata.shape)} / num_splits "
                 f"{tuple(num_splits.shape)}: pass get_mla_metadata's results for this batch")
        planned = tile_scheduler_metadata[0, 5:].cpu().tolist()
        blocks = int(((cache_seqlens.cpu().long() + FLASH_MLA_PAGE_BLOCK_SIZE - 1) // FLASH_MLA_PAGE_BLOCK_SIZE).sum())
        _require(planned == [blocks, s_q * h_q, b],
                 "the tile scheduler metadata was planned for other cache_seqlens or head counts "
                 "(num_heads_per_head_k must be seq_len_q * num_heads_q // num_heads_k)")
        seqlens = cache_seqlens.cpu().long().tolist()
        need = max((-(-n // FLASH_MLA_PAGE_BLOCK_SIZE) for n in seqlens), default=0)
        _require(block_table.shape[1] >= need, f"block_table has {block_table.shape[1]} columns, "
                 f"cache_seqlens need {need}")
        scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
        rows = k_cache.reshape(-1, d).cpu()
        table = block_table.cpu().long()
        out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=q.dtype)
        lse = torch.full((b, h_q, s_q), float("inf"), dtype=torch.float32)
        for i, n in enumerate(seqlens):
            pos = torch.arange(n)
            keys = rows[table[i, pos // FLASH_MLA_PAGE_BLOCK_SIZE] * FLASH_MLA_PAGE_BLOCK_SIZE
                        + pos % FLASH_MLA_PAGE_BLOCK_SIZE]
            o, l_i = _attend(q[i].cpu(), keys, keys[:, :head_dim_v], scale, causal)
            out[i] = o.to(q.dtype)
            lse[i] = torch.where(torch.isfinite(l_i), l_i, float("inf")).float()
        self.calls.append(("flash_mla_with_kvcache", {"batch": b, "seq_len_q": s_q, "causal": causal}))
        return out.to(q.device), lse.to(q.device)


# --- FlashInfer MLA -----------------------------------------------------------------------
class EmulatedBatchMLAPagedAttentionWrapper:
    """``flashinfer.mla.BatchMLAPagedAttentionWrapper``'s contract on the CPU."""

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto"):
        _require(isinstance(float_workspace_buffer, torch.Tensor), "float_workspace_buffer must be a tensor")
        _require(backend in ("auto", "fa2", "fa3", "cutlass"), f"unknown backend {backend!r}")
        self._plan: dict | None = None
        self.use_cuda_graph = use_cuda_graph

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
             causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype,
             use_profiler: bool = False) -> None:
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_len_arr", kv_len_arr)):
            _int32(name, t)
        b = kv_len_arr.shape[0]
        _require(qo_indptr.shape[0] == b + 1 and kv_indptr.shape[0] == b + 1,
                 f"qo_indptr [{qo_indptr.shape[0]}] and kv_indptr [{kv_indptr.shape[0]}] must be [batch + 1 = {b + 1}]")
        kv_ptr, kv_len = kv_indptr.cpu().long(), kv_len_arr.cpu().long()
        pages = kv_ptr[1:] - kv_ptr[:-1]
        _require(int(kv_ptr[0]) == 0 and bool((pages >= 0).all()) and int(kv_ptr[-1]) <= kv_indices.shape[0],
                 "kv_indptr must start at 0, not decrease, and end within kv_indices")
        _require(bool((kv_len <= pages * page_size).all()) and bool((kv_len > (pages - 1) * page_size).all()),
                 f"kv_len_arr {kv_len.tolist()} must fit the pages of each request ({pages.tolist()} pages of "
                 f"{page_size}) and use their last page")
        _require(kv_data_type in (torch.float16, torch.bfloat16, torch.float32) and q_data_type == kv_data_type,
                 f"q_data_type {q_data_type} / kv_data_type {kv_data_type} must be one float dtype")
        self._plan = dict(qo=qo_indptr.cpu().long(), kv_ptr=kv_ptr, indices=kv_indices.cpu().long(), kv_len=kv_len,
                          num_heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe, page_size=page_size, causal=causal,
                          sm_scale=float(sm_scale), dtype=q_data_type)

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            profiler_buffer: torch.Tensor | None = None, kv_len: torch.Tensor | None = None,
            page_table: torch.Tensor | None = None, return_lse_base_on_e: bool = False):
        p = self._plan
        _require(p is not None, "run() before plan()")
        n, h = q_nope.shape[:2]
        _require(tuple(q_nope.shape) == (n, p["num_heads"], p["ckv"]) and tuple(q_pe.shape) == (n, h, p["kpe"]),
                 f"q_nope {tuple(q_nope.shape)} / q_pe {tuple(q_pe.shape)} must be [n, {p['num_heads']}, {p['ckv']}] / "
                 f"[n, heads, {p['kpe']}] as planned")
        _require(n == int(p["qo"][-1]), f"{n} query rows but qo_indptr[-1] = {int(p['qo'][-1])}")
        _require(ckv_cache.dim() == 3 and ckv_cache.shape[1:] == (p["page_size"], p["ckv"])
                 and kpe_cache.shape == (ckv_cache.shape[0], p["page_size"], p["kpe"]),
                 f"ckv_cache {tuple(ckv_cache.shape)} / kpe_cache {tuple(kpe_cache.shape)} must be "
                 f"[pages, {p['page_size']}, {p['ckv']}] / [pages, {p['page_size']}, {p['kpe']}]")
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            _require(t.dtype == p["dtype"], f"{name}.dtype={t.dtype} does not match the planned {p['dtype']}")
        ps = p["page_size"]
        res = torch.zeros(n, h, p["ckv"], dtype=q_nope.dtype)
        lse_e = torch.full((n, h), float("-inf"), dtype=torch.float64)
        ckv, kpe = ckv_cache.cpu(), kpe_cache.cpu()
        for i in range(len(p["kv_len"])):
            q0, q1 = int(p["qo"][i]), int(p["qo"][i + 1])
            pages = p["indices"][int(p["kv_ptr"][i]): int(p["kv_ptr"][i + 1])]
            pos = torch.arange(int(p["kv_len"][i]))
            c_rows, r_rows = ckv[pages[pos // ps], pos % ps], kpe[pages[pos // ps], pos % ps]
            q = torch.cat([q_nope[q0:q1], q_pe[q0:q1]], -1).cpu()
            o, l_i = _attend(q, torch.cat([c_rows, r_rows], -1), c_rows, p["sm_scale"], p["causal"])
            res[q0:q1], lse_e[q0:q1] = o.to(q_nope.dtype), l_i.transpose(0, 1)
        result = res.to(q_nope.device)
        if out is not None:
            _require(out.shape == q_nope.shape and out.dtype == q_nope.dtype, "out must match q_nope")
            out.copy_(result)
            result = out
        if not return_lse:
            return result
        val = (lse_e if return_lse_base_on_e else lse_e / math.log(2)).float().to(q_nope.device)
        if lse is not None:
            lse.copy_(val)
            val = lse
        return result, val


EMULATED_FLASHINFER_MLA = SimpleNamespace(
    mla=SimpleNamespace(BatchMLAPagedAttentionWrapper=EmulatedBatchMLAPagedAttentionWrapper),
    __version__="0.6.18-emulated")
"""A ``flashinfer`` stand-in exposing ``mla.BatchMLAPagedAttentionWrapper``."""
