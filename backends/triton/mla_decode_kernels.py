"""The Triton MLA decode kernel: absorbed queries over the paged latent cache, split-KV.

Loaded through ``runtime.kernel_module("mla_decode_kernels")`` (decorated in the process's
Triton mode). Work decomposition: one program per (decode request, block of ``BLOCK_H``
query heads, KV split). A program walks its split's keys ``BLOCK_N`` at a time: loads
their latent rows (``[BLOCK_N, L]``) and rope parts (``[BLOCK_N, R]``) through the block
table, scores ``q_lat . k_lat + q_pe . k_pe`` for all its heads with two ``tl.dot``, and
keeps an online softmax whose accumulator is the weighted latent (the values ARE the
latent rows: MQA with one KV head). It stores un-normalised partials (running max in
natural log, sum, accumulator) per split; ``backends/mla/triton/decode.py`` combines the
splits. Keys past ``seq_len`` are never loaded (masked loads), so no stale or poisoned row
of the null block is read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnplug.backends.triton.runtime import interpreting

INTERPRETED: bool = interpreting()
"""Whether the kernels below were decorated for the Triton interpreter."""


@triton.jit(do_not_specialize=["num_heads"])
def mla_decode_kernel(
    q_ptr,            # [num_decodes, num_heads, L + R], cache dtype, last dim contiguous
    cache_ptr,        # [num_blocks, BLOCK_SIZE, L + R], last dim contiguous
    block_table_ptr,  # [num_decodes, >= cdiv(max_seq_len, BLOCK_SIZE)] int32
    seq_lens_ptr,     # [num_decodes] int32
    part_acc_ptr,     # [num_decodes, num_heads, NUM_SPLITS, L_PAD] fp32
    part_max_ptr,     # [num_decodes, num_heads, NUM_SPLITS] fp32, natural-log running max
    part_sum_ptr,     # [num_decodes, num_heads, NUM_SPLITS] fp32
    num_heads,
    scale,
    stride_q_tok, stride_q_head,
    stride_c_blk, stride_c_tok,
    stride_bt_req,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    L_PAD: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    q_row = q_ptr + req.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head
    q_lat = tl.load(q_row + dl[None, :], mask=head_ok[:, None] & (dl[None, :] < KV_LORA_RANK), other=0.0)
    q_pe = tl.load(q_row + KV_LORA_RANK + dr[None, :], mask=head_ok[:, None] & (dr[None, :] < ROPE_DIM), other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        live = pos < end
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        row = cache_ptr + block * stride_c_blk + (pos % BLOCK_SIZE).to(tl.int64) * stride_c_tok
        k_lat = tl.load(row[:, None] + dl[None, :], mask=live[:, None] & (dl[None, :] < KV_LORA_RANK), other=0.0)
        k_pe = tl.load(row[:, None] + KV_LORA_RANK + dr[None, :], mask=live[:, None] & (dr[None, :] < ROPE_DIM),
                       other=0.0)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = tl.where(live[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=DOT_PRECISION)
        m = m_new

    part = (req.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
    tl.store(part_acc_ptr + part[:, None] * L_PAD + dl[None, :], acc, mask=head_ok[:, None])
    tl.store(part_max_ptr + part, m, mask=head_ok)
    tl.store(part_sum_ptr + part, l_sum, mask=head_ok)
