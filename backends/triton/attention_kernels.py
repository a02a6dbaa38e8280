"""Triton kernels of the paged attention: the unified kernel and the split-KV reduce.

Imported only through :func:`attnplug.backends.triton.runtime.kernel_module` (the
decoration mode, compiled or interpreted, is fixed when this module is executed). The
launch logic and the choice of tile sizes live in ``attention.py``.

Work decomposition of :func:`paged_attention_kernel` (grid ``(num_q_tiles, num_kv_heads,
NUM_SEGMENTS)``)::

    program (tile, kv_head, segment)
      request r     = the request whose query tiles contain `tile` (binary search over
                      tile_start(i) = query_start_loc[i] // BLOCK_Q + i)
      query rows    = BLOCK_Q query tokens of r  x  the NUM_QUERIES_PER_KV query heads of
                      kv_head, flattened to BLOCK_M rows (token-major): one K/V load serves
                      every query head of the KV head (GQA/MQA)
      keys          = [key_lo, key_hi) of r: key_hi = last query position + 1 (causal,
                      bottom-right aligned), key_lo = first query position - W + 1 (sliding
                      window); key tiles wholly outside are never visited (loop bounds)
      segment       = NUM_SEGMENTS == 1: all of those key tiles, normalised output
                      written to `output`; NUM_SEGMENTS > 1: the segment-th contiguous share
                      of the key tiles, unnormalised fp32 partials (acc, running max, running
                      sum) written for :func:`reduce_segments_kernel`

``tile_start(i+1) - tile_start(i) >= cdiv(query_len_i, BLOCK_Q)``, so launching
``num_tokens // BLOCK_Q + num_reqs`` tiles covers every query; surplus tiles return at
once. Logits, softmax (base 2, online) and the accumulator are fp32. With ``STORE_LSE``
(cascade attention's prefix and suffix passes) the unified path also stores each
(token, head)'s log-sum-exp of the scaled (capped) logits in *natural log*, converted from
the base-2 running max and sum: ``lse = (m + log2(l)) * ln 2``; ``-inf`` for a row that saw
no key. That is the convention of ``backends/common/merge.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnplug.backends.triton.runtime import interpreting

INTERPRETED: bool = interpreting()
"""Whether the kernels below were decorated for the Triton interpreter."""


@triton.jit(do_not_specialize=["num_reqs"])  # one compile for every batch size (1 and multiples of 16 too)
def paged_attention_kernel(
    query_ptr,            # [num_tokens, num_heads, HEAD_SIZE], fp32/fp16/bf16, last dim contiguous
    key_cache_ptr, value_cache_ptr,  # each [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE] (strided), q's dtype
    output_ptr,           # [num_tokens, num_heads, HEAD_SIZE], written when NUM_SEGMENTS == 1
    # split-KV partials (NUM_SEGMENTS > 1): acc [num_tokens, num_heads, NUM_SEGMENTS, HEAD_SIZE_PADDED],
    # base-2 running max and running sum of exp2 [num_tokens, num_heads, NUM_SEGMENTS]; fp32
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    query_start_loc_ptr, seq_lens_ptr,  # [num_reqs + 1] and [num_reqs] int32, tokens
    block_table_ptr,      # [num_reqs, >= cdiv(max_seq_len, BLOCK_SIZE)] int32, kernel block ids
    visited_tiles_ptr,    # [num_q_tiles, num_kv_heads, NUM_SEGMENTS] int32 (RECORD_VISITED only; a test aid)
    lse_ptr,              # [num_tokens, num_heads] fp32 (strided), natural-log LSE (STORE_LSE only)
    sinks_ptr, alibi_ptr,  # [num_heads] fp32 sink logits / ALiBi slopes, natural-log domain (USE_SINKS / USE_ALIBI)
    k_scale_ptr, v_scale_ptr,  # [num_kv_heads] fp32 K / V descales: real = stored * scale (KV_FP8 only)
    num_reqs,             # int32
    scale, soft_cap,      # fp32: softmax scale (natural-log domain), logits soft-cap (read only when USE_SOFT_CAP)
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_k_blk, stride_k_tok, stride_k_head, stride_v_blk, stride_v_tok, stride_v_head,
    stride_bt_req, stride_lse_tok, stride_lse_head,
    NUM_QUERIES_PER_KV: tl.constexpr,  # num_heads // num_kv_heads
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,  # padded: next power of two >= max(HEAD_SIZE, 16)
    BLOCK_SIZE: tl.constexpr,          # tokens per kernel block (page)
    BLOCK_M: tl.constexpr,             # query rows per program (power of two >= 16)
    BLOCK_Q: tl.constexpr,             # query tokens per program: BLOCK_M // NUM_QUERIES_PER_KV
    TILE_N: tl.constexpr,              # keys per inner iteration (power of two >= 16)
    CAUSAL: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,      # W tokens (current included); 0 = full attention
    NUM_SEGMENTS: tl.constexpr,        # 1: unified single pass; > 1: split-KV partials
    DOT_PRECISION: tl.constexpr,       # "ieee" for fp32 inputs (no TF32), "tf32" otherwise (ignored)
    RECORD_VISITED: tl.constexpr,      # store how many key tiles each program visited
    KV_SAME_STRIDES: tl.constexpr,     # value_cache strides == key_cache strides (blocks, tokens)
    STORE_LSE: tl.constexpr,           # also store each row's log-sum-exp (NUM_SEGMENTS == 1 only)
    USE_SINKS: tl.constexpr,           # one more logit per head in the denominator, no value
    USE_ALIBI: tl.constexpr,           # logits - slope_h * (query position - key position)
    KV_FP8: tl.constexpr,              # the caches are fp8: cast to q's dtype, descale (core/kv_quant.py)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    req, q_begin, q_len, first_q, seq_len, key_lo, key_hi, tile_lo, tile_hi = _tile_request_and_keys(
        query_start_loc_ptr, seq_lens_ptr, tile, num_reqs, segment, BLOCK_Q, TILE_N, CAUSAL, SLIDING_WINDOW,
        NUM_SEGMENTS)
    if first_q >= q_len:
        return
    ctx_len = seq_len - q_len  # position of query 0 (bottom-right alignment)
    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx < q_len)
    q_pos = ctx_len + q_idx
    token = (q_begin + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    dim_valid = dims < HEAD_SIZE
    q = tl.load(query_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    if RECORD_VISITED:
        tl.store(visited_tiles_ptr + (tile * tl.num_programs(1) + kv_head) * NUM_SEGMENTS + segment,
                 tl.maximum(tile_hi - tile_lo, 0))

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    if USE_SINKS:
        m_i, l_i = _sink_start(sinks_ptr, head, row_valid, segment, m_i, l_i)
    if KV_FP8:  # one KV head per program: K's descale folds into the softmax scale, V's into the output
        scale = scale * tl.load(k_scale_ptr + kv_head)
    m_i, l_i, acc = _attend_key_tiles(
        q, m_i, l_i, tile_lo, tile_hi, key_lo, key_hi, q_pos, head, row_valid, dim_valid, dims, alibi_ptr,
        block_table_ptr + req.to(tl.int64) * stride_bt_req, key_cache_ptr + kv_head * stride_k_head,
        value_cache_ptr + kv_head * stride_v_head, scale, soft_cap, stride_k_blk, stride_k_tok, stride_v_blk,
        stride_v_tok, BLOCK_M, HEAD_SIZE_PADDED, BLOCK_SIZE, TILE_N, CAUSAL, SLIDING_WINDOW, USE_SOFT_CAP,
        DOT_PRECISION, KV_SAME_STRIDES, USE_ALIBI, KV_FP8)
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)

    _store_rows(m_i, l_i, acc, token, head, row_valid, dim_valid, dims, segment, output_ptr, part_acc_ptr,
                part_max_ptr, part_sum_ptr, lse_ptr, stride_o_tok, stride_o_head, stride_lse_tok, stride_lse_head,
                NUM_QUERIES_PER_KV, HEAD_SIZE_PADDED, NUM_SEGMENTS, STORE_LSE)


# The device functions below are called at most once per program: a device-function call
# costs the interpreter about a millisecond (``triton.runtime.interpreter`` patches
# ``triton.language`` on each), so none is called per key tile (the key-tile loop is one
# function, not its body): the kernel calls each at most once. A GPU compile inlines them.


@triton.jit
def _sink_start(sinks_ptr, head, row_valid, segment, m_i, l_i):
    """The online softmax's state ``(m_i, l_i)`` with the sink entered as a key seen before
    all others (running max = the sink in base 2, sum = exp2(0) = 1, no value); segment 0
    only, so the reduce counts it once."""
    sink = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf")) * 1.4426950408889634
    has_sink = row_valid & (segment == 0)
    return tl.where(has_sink, sink, m_i), tl.where(has_sink, 1.0, l_i)


@triton.jit
def _tile_request_and_keys(query_start_loc_ptr, seq_lens_ptr, tile, num_reqs, segment, BLOCK_Q: tl.constexpr,
                           TILE_N: tl.constexpr, CAUSAL: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
                           NUM_SEGMENTS: tl.constexpr):
    """``(req, q_begin, q_len, first_q, seq_len, key_lo, key_hi, tile_lo, tile_hi)``, int32
    scalars: the request of query tile ``tile`` (the largest ``i`` with
    ``query_start_loc[i] // BLOCK_Q + i <= tile``, by binary search), its first token and
    query count, the tile's first query index (``>= q_len``: a surplus tile, nothing to do)
    and the request's key count; then the keys ``[key_lo, key_hi)`` any query of the tile
    may see (bottom-right aligned) and this segment's share ``[tile_lo, tile_hi)`` of their
    ``TILE_N``-key tiles (empty when ``tile_hi <= tile_lo``)."""
    req = tile * 0  # int32 scalar (loop-carried types must not change)
    hi = req + num_reqs
    while hi - req > 1:
        mid = (req + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            req = mid
        else:
            hi = mid
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    first_q = (tile - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len
    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
    if CAUSAL:
        key_hi = ctx_len + last_q + 1
    else:
        key_hi = seq_len
    if SLIDING_WINDOW > 0:
        key_lo = tl.maximum(ctx_len + first_q - SLIDING_WINDOW + 1, 0)
    else:
        key_lo = seq_len * 0
    tile_lo = key_lo // TILE_N
    tile_hi = (key_hi + TILE_N - 1) // TILE_N
    if NUM_SEGMENTS > 1:
        per_segment = (tile_hi - tile_lo + NUM_SEGMENTS - 1) // NUM_SEGMENTS
        tile_lo = tile_lo + segment * per_segment
        tile_hi = tl.minimum(tile_lo + per_segment, tile_hi)
    return req, q_begin, q_len, first_q, seq_len, key_lo, key_hi, tile_lo, tile_hi


@triton.jit
def _store_rows(m_i, l_i, acc, token, head, row_valid, dim_valid, dims, segment, output_ptr, part_acc_ptr,
                part_max_ptr, part_sum_ptr, lse_ptr, stride_o_tok, stride_o_head, stride_lse_tok, stride_lse_head,
                NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
                STORE_LSE: tl.constexpr):
    """The program's result for its valid rows (``token``, ``head`` per row): with one segment
    ``acc / l_i`` into ``output`` (its dtype) and, with ``STORE_LSE``, the natural-log LSE;
    else the unnormalised fp32 partials ``(acc, m_i, l_i)`` of ``segment``."""
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(output_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
                 out.to(output_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
        if STORE_LSE:
            # natural log: ln(sum_k e^{s_k}) = (m_i + log2(l_i)) * ln(2) in the base-2 domain;
            # -inf for a row that saw no key (l_i == 0)
            lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
                           * 0.6931471805599453)
            tl.store(lse_ptr + token * stride_lse_tok + head * stride_lse_head, lse, mask=row_valid)
    else:
        part = (token * tl.num_programs(1) * NUM_QUERIES_PER_KV + head) * NUM_SEGMENTS + segment
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_SIZE_PADDED + dims[None, :], acc,
                 mask=row_valid[:, None])


@triton.jit
def _attend_key_tiles(q, m_i, l_i, tile_lo, tile_hi, key_lo, key_hi, q_pos, head, row_valid, dim_valid, dims, alibi_ptr,
                      bt_row, k_head, v_head, scale, soft_cap, stride_k_blk, stride_k_tok, stride_v_blk,
                      stride_v_tok, BLOCK_M: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, CAUSAL: tl.constexpr,
                      SLIDING_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      KV_SAME_STRIDES: tl.constexpr, USE_ALIBI: tl.constexpr, KV_FP8: tl.constexpr):
    """The online softmax over key tiles ``[tile_lo, tile_hi)`` of one request and KV head:
    ``(m_i, l_i, acc)``, the base-2 running max and sum per row and the unnormalised fp32
    ``[BLOCK_M, HEAD_SIZE_PADDED]`` accumulator, from the state ``(m_i, l_i)`` given.
    ``bt_row``: the request's block-table row; ``k_head`` / ``v_head``: the caches at this
    KV head; ``scale``: the softmax scale (with an fp8 cache's K descale folded in);
    ``alibi_ptr``: the ``[num_heads]`` slopes (read only with ``USE_ALIBI``)."""
    acc = tl.full([BLOCK_M, HEAD_SIZE_PADDED], 0.0, dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): logits go to base 2 for exp2
    # Loop invariants (hoisted by hand: the interpreter pays per operation).
    key_offsets = tl.arange(0, TILE_N)
    dims_row = dims[None, :]
    dim_valid_row = dim_valid[None, :]
    row_valid_col = row_valid[:, None]
    q_pos_col = q_pos[:, None]
    oldest_col = q_pos_col - SLIDING_WINDOW  # keys must be > this (window rows only)
    if USE_ALIBI:  # per row (query head) slope, base 2 like the scaled logits
        alibi_col = (tl.load(alibi_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634)[:, None]

    for t in range(tile_lo, tile_hi):
        keys = t * TILE_N + key_offsets
        key_live = (keys >= key_lo) & (keys < key_hi)
        block = tl.load(bt_row + keys // BLOCK_SIZE, mask=key_live, other=0).to(tl.int64)
        in_block = keys % BLOCK_SIZE
        k_rows = block * stride_k_blk + in_block * stride_k_tok
        kv_mask = key_live[:, None] & dim_valid_row
        k = tl.load(k_head + k_rows[:, None] + dims_row, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] fp32
        if USE_SOFT_CAP:
            # cap * tanh(x / cap) with tanh(y) = sign(y) * (1 - 2 / (exp(2|y|) + 1)), 2|y| clamped
            # at 40 (tanh is 1 in fp32 there) so nothing overflows
            y = s * (scale / soft_cap)
            th = 1.0 - 2.0 / (tl.exp(tl.minimum(2.0 * tl.abs(y), 40.0)) + 1.0)
            s = tl.where(y < 0, -th, th) * (soft_cap * 1.4426950408889634)
        else:
            s = s * qk_scale
        keys_row = keys[None, :]
        if USE_ALIBI:  # after scale and soft-cap, before masking (vLLM's order)
            s = s - alibi_col * (q_pos_col - keys_row).to(tl.float32)
        visible = row_valid_col & key_live[None, :]
        if CAUSAL:
            visible = visible & (keys_row <= q_pos_col)
        if SLIDING_WINDOW > 0:
            visible = visible & (keys_row > oldest_col)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_SAME_STRIDES:  # K and V halves of one cache: same row offsets
            v_rows = k_rows
        else:
            v_rows = block * stride_v_blk + in_block * stride_v_tok
        v = tl.load(v_head + v_rows[:, None] + dims_row, mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_reqs"])
def reduce_segments_kernel(
    output_ptr,           # [num_tokens, num_heads, HEAD_SIZE]
    part_acc_ptr,         # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_SIZE_PADDED] fp32
    part_max_ptr,         # [num_tokens, num_heads, NUM_SEGMENTS] fp32
    part_sum_ptr,         # [num_tokens, num_heads, NUM_SEGMENTS] fp32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_reqs,             # int32
    num_heads,            # int32
    stride_o_tok, stride_o_head,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,  # power of two
):
    """Grid ``(num_tokens, cdiv(num_heads, HEADS_PER_PROGRAM))``: combine the segments of
    ``HEADS_PER_PROGRAM`` heads of one token.

    ``out = sum_s acc_s * 2^(m_s - M) / sum_s l_s * 2^(m_s - M)`` with ``M = max_s m_s``;
    empty segments have ``m_s = -inf`` and weigh 0. Tokens past ``query_start_loc[num_reqs]``
    (padding) are skipped: their partials were never written."""
    token = tl.program_id(0)
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    head_ok = heads < num_heads
    base = (token.to(tl.int64) * num_heads + heads) * NUM_SEGMENTS  # [HEADS_PER_PROGRAM]
    segs = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    part = base[:, None] + segs[None, :]  # [HEADS_PER_PROGRAM, NUM_SEGMENTS]
    m = tl.load(part_max_ptr + part, mask=head_ok[:, None], other=0.0)
    l = tl.load(part_sum_ptr + part, mask=head_ok[:, None], other=0.0)
    m_all = tl.max(m, axis=1)
    w = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all)[:, None])
    total = tl.sum(l * w, axis=1)
    acc = tl.load(part_acc_ptr + part[:, :, None] * HEAD_SIZE_PADDED + dims[None, None, :],
                  mask=head_ok[:, None, None], other=0.0)
    out = tl.sum(acc * w[:, :, None], axis=1) / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(output_ptr + token.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :],
             out.to(output_ptr.dtype.element_ty), mask=head_ok[:, None] & (dims[None, :] < HEAD_SIZE))
