"""The Triton kernels of sparse attention (DeepSeek-V3.2): the indexer's scores and the
sparse MLA consumer.

Loaded through ``runtime.kernel_module("sparse_kernels")`` (decorated in the process's
Triton mode); entry points in ``backends/sparse/triton/``.

* ``indexer_scores_kernel``: one program per (query token, tile of ``BLOCK_N`` key
  positions). Loads the tile's key rows of the query's request through the block table
  (masked loads: positions outside ``[key_start, key_end)`` are never read), scores all
  heads with one ``tl.dot`` (``[H_PAD, D_PAD] x [D_PAD, BLOCK_N]``), applies
  ``relu(scale * .)`` and the per-head weights, and stores ``-inf`` outside the range.
* ``sparse_mla_kernel``: one program per (query token, block of ``BLOCK_H`` heads). Walks
  the query's ``TOPK`` selected slots ``BLOCK_N`` at a time (``-1``: masked, never read),
  scores ``q_lat . k_lat + q_pe . k_pe`` with two ``tl.dot`` and keeps an online softmax
  whose accumulator is the weighted latent (MQA with one latent head, as
  ``mla_decode_kernel``); a tile with no live slot contributes nothing (guarded max).
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnplug.backends.triton.runtime import interpreting

INTERPRETED: bool = interpreting()
"""Whether the kernels below were decorated for the Triton interpreter."""


@triton.jit
def indexer_scores_kernel(
    q_ptr,            # [T, H, D], last dim contiguous
    w_ptr,            # [T, H] fp32, contiguous
    cache_ptr,        # [num_blocks, BLOCK_SIZE, D], last dim contiguous
    block_table_ptr,  # [num_reqs, max_blocks] int32
    req_ptr,          # [T] int64
    key_start_ptr,    # [T] int32
    key_end_ptr,      # [T] int32
    scores_ptr,       # [T, S] fp32
    num_keys,         # S
    scale,
    stride_q_tok, stride_q_head,
    stride_c_blk, stride_c_tok,
    stride_bt_req,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tok = tl.program_id(0)
    tile = tl.program_id(1)
    req = tl.load(req_ptr + tok)
    k_start = tl.load(key_start_ptr + tok)
    k_end = tl.load(key_end_ptr + tok)
    pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (pos >= k_start) & (pos < k_end)
    hh = tl.arange(0, H_PAD)
    dd = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + tok.to(tl.int64) * stride_q_tok + hh[:, None] * stride_q_head + dd[None, :],
                mask=(hh[:, None] < NUM_HEADS) & (dd[None, :] < HEAD_DIM), other=0.0)
    w = tl.load(w_ptr + tok.to(tl.int64) * NUM_HEADS + hh, mask=hh < NUM_HEADS, other=0.0)
    block = tl.load(block_table_ptr + req * stride_bt_req + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    row = cache_ptr + block * stride_c_blk + (pos % BLOCK_SIZE).to(tl.int64) * stride_c_tok
    k = tl.load(row[:, None] + dd[None, :], mask=live[:, None] & (dd[None, :] < HEAD_DIM), other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)          # [H_PAD, BLOCK_N]
    s = tl.maximum(s * scale, 0.0)
    score = tl.sum(w[:, None] * s, 0)
    score = tl.where(live, score, float("-inf"))
    tl.store(scores_ptr + tok.to(tl.int64) * num_keys + pos, score, mask=pos < num_keys)


@triton.jit(do_not_specialize=["num_heads"])
def sparse_mla_kernel(
    q_ptr,            # [T, num_heads, L + R], cache dtype, last dim contiguous
    rows_ptr,         # [num_rows, L + R]: the latent cache viewed flat, last dim contiguous
    slots_ptr,        # [T, TOPK] int64, -1 = none
    o_ptr,            # [T, num_heads, L_PAD] fp32
    lse_ptr,          # [num_heads, T] fp32
    num_heads,
    num_tokens,
    scale,
    stride_q_tok, stride_q_head,
    stride_row,
    stride_s_tok,
    TOPK: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    L_PAD: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tok = tl.program_id(0)
    head_block = tl.program_id(1)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    q_row = q_ptr + tok.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head
    q_lat = tl.load(q_row + dl[None, :], mask=head_ok[:, None] & (dl[None, :] < KV_LORA_RANK), other=0.0)
    q_pe = tl.load(q_row + KV_LORA_RANK + dr[None, :], mask=head_ok[:, None] & (dr[None, :] < ROPE_DIM), other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], tl.float32)
    for n0 in range(0, TOPK, BLOCK_N):
        kk = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + tok.to(tl.int64) * stride_s_tok + kk, mask=kk < TOPK, other=-1)
        live = slot >= 0
        row = rows_ptr + tl.where(live, slot, 0) * stride_row
        k_lat = tl.load(row[:, None] + dl[None, :], mask=live[:, None] & (dl[None, :] < KV_LORA_RANK), other=0.0)
        k_pe = tl.load(row[:, None] + KV_LORA_RANK + dr[None, :], mask=live[:, None] & (dr[None, :] < ROPE_DIM),
                       other=0.0)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = tl.where(live[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=DOT_PRECISION)
        m = m_new

    has = l_sum > 0
    o = acc / tl.where(has, l_sum, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
    tl.store(o_ptr + (tok.to(tl.int64) * num_heads + heads)[:, None] * L_PAD + dl[None, :], o, mask=head_ok[:, None])
    tl.store(lse_ptr + heads.to(tl.int64) * num_tokens + tok, lse, mask=head_ok)
