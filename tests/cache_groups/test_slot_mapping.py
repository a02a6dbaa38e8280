"""Slot mapping: ``slot = block_table[req, pos // B] * B + pos % B``, vectorized, padded."""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.cache_groups.block_table import BlockTable
from attnplug.cache_groups.ragged import cumsum_and_arange, repeat_indices
from attnplug.core.constants import PAD_SLOT_ID


def test_cumsum_and_arange_seed_example():
    cu, ar = cumsum_and_arange(np.array([2, 5, 3]))
    assert cu.tolist() == [2, 7, 10]
    assert ar.tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
    assert repeat_indices(np.array([2, 5, 3])).tolist() == [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
    buf = np.arange(16, dtype=np.int64)
    assert cumsum_and_arange(np.array([1, 0, 2]), buf)[1].tolist() == [0, 0, 1]
    assert cumsum_and_arange(np.zeros(0, dtype=np.int64))[1].tolist() == []


def seed_table() -> BlockTable:
    bt = BlockTable(4, max_num_reqs=4, max_num_blocks_per_req=4, max_num_batched_tokens=16)
    bt.add_row([1, 2], 0)      # A: logical 1 -> physical 2
    bt.add_row([5], 1)         # B
    bt.add_row([3, 6, 4], 2)   # C: logical 2 -> physical 4
    return bt


def test_seed_slot_mapping_example():
    bt = seed_table()
    req_indices = np.array([0, 1, 1, 1, 2, 2])
    positions = np.array([5, 0, 1, 2, 8, 9])
    slots = bt.compute_slot_mapping(req_indices, positions)
    assert slots.tolist() == [9, 20, 21, 22, 16, 17]
    # A's position 5: logical block 1 -> physical 2, offset 1 -> 2*4+1 (hand check, seed breakpoint 6)
    assert slots[0].item() == 2 * 4 + 5 % 4


def test_padding_gets_pad_slot_id():
    bt = seed_table()
    slots = bt.compute_slot_mapping(np.array([0, 1]), np.array([5, 0]), num_tokens_padded=5)
    assert slots.tolist() == [9, 20, PAD_SLOT_ID, PAD_SLOT_ID, PAD_SLOT_ID]
    # a shorter step afterwards does not see stale slots in its padding either
    assert bt.compute_slot_mapping(np.array([1]), np.array([1]), 3).tolist() == [21, PAD_SLOT_ID, PAD_SLOT_ID]


@pytest.mark.parametrize("block_size,kernel", [(16, 16), (32, 16), (64, 8)])
def test_random_slots_match_the_per_token_formula_in_either_block_unit(block_size, kernel):
    rng = np.random.default_rng(block_size + kernel)
    R, M = 5, 6
    bt = BlockTable(block_size, R, M, 256, kernel_block_size=kernel)
    rows = [rng.choice(np.arange(1, 500), size=rng.integers(1, M + 1), replace=False).tolist() for _ in range(R)]
    for r, ids in enumerate(rows):
        bt.add_row(ids, r)
    counts = rng.integers(0, 20, size=R)
    req = np.repeat(np.arange(R), counts)
    pos = np.array([rng.integers(0, len(rows[r]) * block_size) for r in req], dtype=np.int64)
    slots = bt.compute_slot_mapping(req, pos).tolist()
    k = block_size // kernel
    ktable = bt.kernel_block_table.np
    for t, (r, p) in enumerate(zip(req, pos)):
        assert slots[t] == rows[r][p // block_size] * block_size + p % block_size
        # the same slot in kernel blocks: kernel id * kernel size + offset
        assert slots[t] == ktable[r, p // kernel] * kernel + p % kernel
        assert ktable[r, p // kernel] == rows[r][p // block_size] * k + (p % block_size) // kernel
