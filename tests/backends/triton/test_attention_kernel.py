"""The paged attention kernels (Triton interpreter) against a dense float64 reference."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.triton import choose_tiles, paged_attention
from attnplug.backends.triton.attention import compute_capability
from attnplug.backends.triton.attention import num_query_tiles
from attnplug.core.errors import MetadataError

MIXED = [(10, 1), (0, 9), (20, 5), (31, 1), (0, 1)]
ATOL = {torch.float32: 2e-5, torch.float16: 5e-3}


def _close(got, want, dtype, n):
    err = (got[:n].double() - want).abs().max().item()
    assert err <= ATOL[dtype], f"max |error| {err:.3g} > {ATOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_prefill_decode_batch_in_one_launch(paged_batch, dtype):
    b = paged_batch(MIXED, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype)
    _close(b.run(), b.reference(), dtype, b.num_actual_tokens)
    _close(b.run(tiles=b.tiles(interpreter=True)), b.reference(), dtype, b.num_actual_tokens)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 1), (6, 2), (12, 2)], ids=["mha", "mqa", "group3", "group6"])
def test_query_heads_of_a_kv_head_share_one_tile(paged_batch, heads, kv_heads):
    b = paged_batch([(17, 1), (0, 13), (9, 4)], num_heads=heads, num_kv_heads=kv_heads)
    _close(b.run(), b.reference(), torch.float32, b.num_actual_tokens)


@pytest.mark.parametrize("head_size", [16, 48, 80, 256])
def test_head_sizes_padded_to_a_power_of_two(paged_batch, head_size):
    b = paged_batch([(6, 1), (0, 5)], num_heads=2, num_kv_heads=1, head_size=head_size)
    _close(b.run(), b.reference(), torch.float32, b.num_actual_tokens)


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_kernel_block_sizes(paged_batch, block_size):
    b = paged_batch([(70, 1), (3, 30), (40, 2)], block_size=block_size)
    _close(b.run(), b.reference(), torch.float32, b.num_actual_tokens)


@pytest.mark.parametrize("window", [1, 5, 33, 1000])
def test_sliding_window(paged_batch, window):
    b = paged_batch([(80, 1), (0, 40), (50, 9), (2, 1)])
    _close(b.run(sliding_window=window), b.reference(sliding_window=window), torch.float32, b.num_actual_tokens)


def test_soft_cap_with_and_without_window(paged_batch):
    b = paged_batch([(9, 1), (0, 8), (40, 4)])
    b.query *= 4.0  # logits well past the cap
    _close(b.run(logits_soft_cap=5.0), b.reference(soft_cap=5.0), torch.float32, b.num_actual_tokens)
    _close(b.run(logits_soft_cap=5.0, sliding_window=6), b.reference(soft_cap=5.0, sliding_window=6),
           torch.float32, b.num_actual_tokens)


def test_non_causal(paged_batch):
    b = paged_batch([(5, 4), (0, 7)])
    _close(b.run(causal=False), b.reference(causal=False), torch.float32, b.num_actual_tokens)


def test_key_tiles_outside_the_window_are_not_visited(paged_batch):
    """Loop bounds, not masks: a decode at position 999 with a 40-token window visits only
    the key tiles overlapping [960, 999]; a causal prefill tile visits none past its last query."""
    b = paged_batch([(999, 1), (0, 64)], num_heads=2, num_kv_heads=1, block_size=64)
    cfg = b.tiles()
    tiles = num_query_tiles(b.query.shape[0], 2, cfg.block_q)
    visited = torch.full((tiles, 1, 1), -1, dtype=torch.int32)
    b.run(sliding_window=40, visited_tiles=visited)
    # request 0: one query tile; keys 960..999 span cdiv(...) tiles of tile_n keys
    expect_decode = 999 // cfg.tile_n - 960 // cfg.tile_n + 1
    assert int(visited[0, 0, 0]) == expect_decode < 1000 // cfg.tile_n
    # request 1 (prefill of 64 from 0, window 40): each query tile sees at most its own span + 39 keys
    prefill = visited[visited >= 0].flatten()[1:]
    assert len(prefill) == -(-64 // cfg.block_q)
    assert int(prefill.max()) <= -(-(cfg.block_q + 39) // cfg.tile_n) + 1
    # without a window the decode walks the whole context
    visited.fill_(-1)
    b.run(visited_tiles=visited)
    assert int(visited[0, 0, 0]) == -(-1000 // cfg.tile_n)


def test_keys_outside_the_window_and_past_seq_len_are_never_read(paged_batch):
    b = paged_batch([(100, 1), (37, 3)], block_size=16, extra_cols=2, poison=float("nan"))
    window = 20
    want = b.reference(sliding_window=window)
    for i, (c, s) in enumerate(b.requests):  # NaN into every block no query of the step can see
        first_visible = max(0, c - window + 1)
        for blk in range(first_visible // 16):
            b.kv_cache[int(b.block_table[i, blk])] = float("nan")
        b.block_table[i, -(-(c + s) // 16):] = 0  # the null block (NaN-poisoned too)
    b.kv_cache[0] = float("nan")
    got = b.run(sliding_window=window)
    assert torch.isfinite(got[:b.num_actual_tokens]).all()
    _close(got, want, torch.float32, b.num_actual_tokens)


@pytest.mark.parametrize("splits", [2, 16])
def test_split_kv_matches_the_reference(paged_batch, splits):
    """Segments + reduce; with 16 splits most segments of the short requests are empty."""
    b = paged_batch([(150, 1), (3, 1), (64, 1), (90, 6)], num_heads=4, num_kv_heads=2)
    _close(b.run(num_kv_splits=splits), b.reference(), torch.float32, b.num_actual_tokens)


def test_split_kv_with_window_skips_tiles_per_segment(paged_batch):
    b = paged_batch([(150, 1), (64, 1)], num_heads=4, num_kv_heads=2)
    _close(b.run(num_kv_splits=4, sliding_window=17), b.reference(sliding_window=17), torch.float32,
           b.num_actual_tokens)


def test_split_kv_fp16(paged_batch):
    b = paged_batch([(300, 1), (45, 1)], dtype=torch.float16)
    _close(b.run(num_kv_splits=8), b.reference(), torch.float16, b.num_actual_tokens)


def test_padding_rows_and_empty_requests_are_left_untouched(paged_batch):
    b = paged_batch([(5, 1), (12, 3)], num_pad_tokens=5)
    sentinel = torch.full_like(b.query, 123.0)
    out = b.run(output=sentinel.clone())
    assert torch.equal(out[b.num_actual_tokens:], sentinel[b.num_actual_tokens:])
    # a padded request with an empty query (as CUDA-graph padding makes) changes nothing
    qsl = torch.cat([b.query_start_loc, b.query_start_loc[-1:]])
    seq_lens = torch.cat([b.seq_lens, torch.ones(1, dtype=torch.int32)])
    bt = torch.cat([b.block_table, torch.zeros(1, b.block_table.shape[1], dtype=torch.int32)])
    out2 = paged_attention(b.query, b.kv_cache[:, 0], b.kv_cache[:, 1], sentinel.clone(), qsl, seq_lens, bt,
                           num_reqs=3, max_query_len=3, scale=b.scale, tiles=b.tiles())
    assert torch.equal(out2, out)


def test_bad_inputs_raise_before_launching(paged_batch):
    b = paged_batch([(5, 1)])
    with pytest.raises(MetadataError, match="num_kv_splits must be a power of two"):
        b.run(num_kv_splits=3)
    with pytest.raises(MetadataError, match="block_table must be int32"):
        paged_attention(b.query, b.kv_cache[:, 0], b.kv_cache[:, 1], torch.zeros_like(b.query), b.query_start_loc,
                        b.seq_lens, b.block_table.long(), num_reqs=1, max_query_len=1, scale=1.0)
    with pytest.raises(MetadataError, match="cache dtype"):
        paged_attention(b.query.half(), b.kv_cache[:, 0], b.kv_cache[:, 1], torch.zeros_like(b.query.half()),
                        b.query_start_loc, b.seq_lens, b.block_table, num_reqs=1, max_query_len=1, scale=1.0)


def test_tile_choice():
    gpu = dict(interpreter=False)
    decode = choose_tiles(1, 4, 128, torch.float16, **gpu)
    assert (decode.block_m, decode.block_q, decode.tile_n) == (16, 4, 64)
    prefill = choose_tiles(500, 4, 128, torch.bfloat16, **gpu)
    assert (prefill.block_m, prefill.block_q) == (64, 16)
    mqa = choose_tiles(1, 64, 64, torch.float16, **gpu)
    assert (mqa.block_m, mqa.block_q) == (64, 1)
    assert choose_tiles(500, 1, 256, torch.float16, **gpu).block_m == 32
    assert choose_tiles(500, 2, 128, torch.float32, **gpu).tile_n == 16
    assert choose_tiles(1, 8, 256, torch.bfloat16, **gpu).tile_n == 16
    interp = choose_tiles(500, 4, 64, torch.float32)  # this process runs the interpreter
    assert (interp.block_m, interp.tile_n) == (128, 128)


@pytest.mark.parametrize("sm, warps", [(None, 8), (80, 8), (86, 8), (90, 4), (100, 4)])
def test_the_16_bit_d128_prefill_tile_takes_4_warps_from_sm90(sm, warps):
    """The H200 sweep (docs/performance.md, "Tile sweep"): 4 warps 1.41x faster on sm_90;
    on sm_80 they would spill, so 8 stay. Other tiles keep their warps on every sm."""
    assert choose_tiles(500, 4, 128, torch.bfloat16, interpreter=False, sm=sm).num_warps == warps
    assert choose_tiles(500, 8, 128, torch.float16, interpreter=False, sm=sm).num_warps == warps
    assert choose_tiles(500, 4, 256, torch.bfloat16, interpreter=False, sm=sm).num_warps == 8
    assert choose_tiles(500, 4, 64, torch.bfloat16, interpreter=False, sm=sm).num_warps == 4
    assert choose_tiles(1, 4, 128, torch.float16, interpreter=False, sm=sm).num_warps == 4


def test_compute_capability_is_none_off_cuda():
    assert compute_capability(torch.device("cpu")) is None
