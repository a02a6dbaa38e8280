"""Triton kernels that address the paged KV cache: K/V write at ``slot_mapping`` and the
runner's per-group slot mapping.

Imported only through :func:`attnplug.backends.triton.runtime.kernel_module`; the
Python entry points are in ``cache_ops.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnplug.backends.triton.runtime import interpreting

INTERPRETED: bool = interpreting()
"""Whether the kernels below were decorated for the Triton interpreter."""


@triton.jit
def _round_to_fp8_grid(x, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """``x`` (fp32, within the fp8 range) rounded to the nearest fp8 value, ties to even, as
    torch's cast rounds: the step is ``2^(max(floor(log2|x|), MIN_EXP) - MANTISSA)``."""
    a = tl.abs(x)
    e = tl.maximum(tl.floor(tl.log2(tl.where(a > 0, a, 1.0))), MIN_EXP)
    step = tl.exp2(e - MANTISSA)
    y = a / step
    r = tl.floor(y + 0.5)
    r = tl.where((r - y == 0.5) & (r % 2 == 1), r - 1, r)
    return tl.where(x < 0, -r * step, r * step)


@triton.jit(do_not_specialize=["num_rows"])  # one compile for every token count
def write_kv_cache_kernel(
    key_ptr,            # [num_tokens, NUM_KV_HEADS, HEAD_SIZE], last dim contiguous
    value_ptr,          # [num_tokens, NUM_KV_HEADS, HEAD_SIZE], last dim contiguous
    key_cache_ptr,      # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE] (strided view)
    value_cache_ptr,    # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE] (strided view)
    slot_mapping_ptr,   # [num_tokens] int64, flat slots; PAD_SLOT_ID (< 0) = skip
    k_scale_ptr,        # [NUM_KV_HEADS] fp32 (KV_FP8 only): stored = saturate(k / k_scale)
    v_scale_ptr,        # [NUM_KV_HEADS] fp32 (KV_FP8 only)
    num_rows,           # int32: num_tokens * NUM_KV_HEADS
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_kc_blk, stride_kc_tok, stride_kc_head,
    stride_vc_blk, stride_vc_tok, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,  # next power of two >= HEAD_SIZE
    ROWS_PER_PROGRAM: tl.constexpr,  # (token, KV head) rows per program, power of two
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,  # fp8 caches: divide by the head's scale, clamp to +-FP8_MAX, cast
    FP8_MAX: tl.constexpr,  # the cache dtype's largest finite value (448 e4m3fn, 57344 e5m2)
    FP8_MANTISSA: tl.constexpr,  # mantissa bits: 3 (e4m3fn), 2 (e5m2)
    FP8_MIN_EXP: tl.constexpr,   # exponent of the smallest normal: -6 (e4m3fn), -14 (e5m2)
    ROUND_ON_GRID: tl.constexpr,  # round to the fp8 grid in fp32 first (the interpreter's cast is wrong)
):
    """Grid ``(cdiv(num_tokens * NUM_KV_HEADS, ROWS_PER_PROGRAM),)``: each program copies
    ``ROWS_PER_PROGRAM`` (token, KV head) rows of K and V, cast to the cache dtype, to the
    token's slot. Rows of padded tokens (negative slot) are masked out: nothing is written."""
    rows = (tl.program_id(0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)).to(tl.int64)
    token = rows // NUM_KV_HEADS
    head = rows % NUM_KV_HEADS
    in_range = rows < num_rows
    slot = tl.load(slot_mapping_ptr + token, mask=in_range, other=-1).to(tl.int64)
    live = in_range & (slot >= 0)
    block = tl.where(live, slot, 0) // BLOCK_SIZE
    in_block = tl.where(live, slot, 0) % BLOCK_SIZE
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    mask = live[:, None] & (dims[None, :] < HEAD_SIZE)
    k = tl.load(key_ptr + token[:, None] * stride_k_tok + head[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token[:, None] * stride_v_tok + head[:, None] * stride_v_head + dims[None, :],
                mask=mask)
    if KV_FP8:  # core/kv_quant.py: saturate(x / scale), per KV head
        k_s = tl.load(k_scale_ptr + head, mask=in_range, other=1.0)
        v_s = tl.load(v_scale_ptr + head, mask=in_range, other=1.0)
        k = tl.minimum(tl.maximum(k.to(tl.float32) / k_s[:, None], -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / v_s[:, None], -FP8_MAX), FP8_MAX)
        if ROUND_ON_GRID:  # the interpreter's fp32 -> fp8 cast loses a rounding carry (124.0 -> 64.0):
            k = _round_to_fp8_grid(k, FP8_MANTISSA, FP8_MIN_EXP)  # round in fp32 so the cast is exact
            v = _round_to_fp8_grid(v, FP8_MANTISSA, FP8_MIN_EXP)
    k_dst = block * stride_kc_blk + in_block * stride_kc_tok + head * stride_kc_head
    v_dst = block * stride_vc_blk + in_block * stride_vc_tok + head * stride_vc_head
    tl.store(key_cache_ptr + k_dst[:, None] + dims[None, :], k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + v_dst[:, None] + dims[None, :], v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_reqs", "num_tokens_padded"])
def slot_mapping_kernel(
    query_start_loc_ptr,  # [num_reqs + 1] int32, tokens
    positions_ptr,        # [num_tokens] int64, position of each token in its request
    block_table_ptr,      # [>= num_reqs, max_num_blocks_per_req] int32, block ids in BLOCK_SIZE units
    slot_mapping_ptr,     # [>= num_tokens_padded] int64, output
    num_reqs,             # int32
    num_tokens_padded,    # int32, slots [query_start_loc[num_reqs], num_tokens_padded) get PAD_SLOT_ID
    stride_bt_req,
    BLOCK_SIZE: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    TOKENS_PER_ITER: tl.constexpr,
):
    """Grid ``(num_reqs + 1,)``: program ``r < num_reqs`` maps request r's tokens,
    ``slot = block_table[r, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE``; the last
    program fills the padding with ``PAD_SLOT``."""
    r = tl.program_id(0)
    offsets = tl.arange(0, TOKENS_PER_ITER)
    if r == num_reqs:
        pad_from = tl.load(query_start_loc_ptr + num_reqs)
        for start in range(pad_from, num_tokens_padded, TOKENS_PER_ITER):
            t = start + offsets
            tl.store(slot_mapping_ptr + t, tl.full([TOKENS_PER_ITER], PAD_SLOT, tl.int64),
                     mask=t < num_tokens_padded)
        return
    begin = tl.load(query_start_loc_ptr + r)
    end = tl.load(query_start_loc_ptr + r + 1)
    row = block_table_ptr + r.to(tl.int64) * stride_bt_req
    for start in range(begin, end, TOKENS_PER_ITER):
        t = start + offsets
        live = (t < end) & (t < num_tokens_padded)  # never past the view the caller gets back
        pos = tl.load(positions_ptr + t, mask=live, other=0)
        block = tl.load(row + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        tl.store(slot_mapping_ptr + t, block * BLOCK_SIZE + pos % BLOCK_SIZE, mask=live)
