"""BlockTable / MultiGroupBlockTable: row operations, kernel-block expansion, commit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.cache_groups.block_table import BlockTable, MultiGroupBlockTable, expand_to_kernel_block_ids
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import KVCacheSpecError, MetadataError


def expected_kernel_row(manager_ids, k, width):
    row = np.full(width, NULL_BLOCK_ID, dtype=np.int32)
    for i, b in enumerate(manager_ids):
        row[i * k:(i + 1) * k] = NULL_BLOCK_ID if b == NULL_BLOCK_ID else np.arange(b * k, b * k + k)
    return row


def assert_consistent(bt: BlockTable, rows: dict[int, list[int]]):
    """Manager table, kernel table and counts agree with ``rows``; everything else is null."""
    k = bt.kernel_blocks_per_block
    for r in range(bt.max_num_reqs):
        ids = rows.get(r, [])
        assert bt.num_blocks_per_row[r] == len(ids)
        assert bt.block_table_np[r, :len(ids)].tolist() == ids
        assert (bt.block_table_np[r, len(ids):] == NULL_BLOCK_ID).all()
        assert bt.kernel_block_table.np[r].tolist() == expected_kernel_row(
            ids, k, bt.max_num_blocks_per_req * k).tolist()


def test_expand_seed_example_32_over_16():
    # The seed: a 32-token manager block over a 16-token kernel block, b -> b*k .. b*k+k-1.
    assert expand_to_kernel_block_ids([1, 2], 2).tolist() == [2, 3, 4, 5]
    assert expand_to_kernel_block_ids([1, 2, 3], 2).tolist() == [2, 3, 4, 5, 6, 7]
    # block 0 is the reserved null block: it stays null in all k entries
    assert expand_to_kernel_block_ids([0, 1, 2], 2).tolist() == [0, 0, 2, 3, 4, 5]
    assert expand_to_kernel_block_ids([7, 0], 4).tolist() == [28, 29, 30, 31, 0, 0, 0, 0]
    assert expand_to_kernel_block_ids([3, 1], 1).tolist() == [3, 1]


@pytest.mark.parametrize("block_size,kernel", [(4, 4), (32, 16), (16, 4)])
def test_row_operations_keep_both_tables_consistent(block_size, kernel):
    bt = BlockTable(block_size, max_num_reqs=4, max_num_blocks_per_req=5, max_num_batched_tokens=16,
                    kernel_block_size=kernel)
    rows: dict[int, list[int]] = {}
    bt.add_row([3, 4], 0)
    rows[0] = [3, 4]
    bt.add_row([7], 2)
    rows[2] = [7]
    assert_consistent(bt, rows)
    bt.append_row([9, 10], 0)
    rows[0] += [9, 10]
    bt.append_row([], 2)
    assert_consistent(bt, rows)
    bt.move_row(0, 1)  # src keeps its blocks
    rows[1] = list(rows[0])
    assert_consistent(bt, rows)
    bt.move_row(2, 1)  # a shorter row over a longer one: the tail becomes null
    rows[1] = [7]
    assert_consistent(bt, rows)
    bt.swap_row(0, 1)
    rows[0], rows[1] = rows[1], rows[0]
    assert_consistent(bt, rows)
    bt.clear_row(1)
    rows.pop(1)
    assert_consistent(bt, rows)
    bt.add_row([11], 0)  # replace (resumed from preemption)
    rows[0] = [11]
    assert_consistent(bt, rows)
    assert bt.row_block_ids(0) == [11]


def test_null_entries_in_a_row_expand_to_null():
    bt = BlockTable(32, 2, 4, 8, kernel_block_size=16)
    bt.add_row([NULL_BLOCK_ID, 5, 6], 1)
    assert bt.kernel_block_table.np[1].tolist() == [0, 0, 10, 11, 12, 13, 0, 0]


def test_append_rows_equals_append_row_one_by_one():
    rng = np.random.default_rng(0)
    a = BlockTable(8, 6, 10, 16, kernel_block_size=2)
    b = BlockTable(8, 6, 10, 16, kernel_block_size=2)
    for _ in range(20):
        rows = rng.permutation(6)[:rng.integers(1, 6)]
        counts = [int(c) for c in rng.integers(0, 3, size=len(rows))]
        if (a.num_blocks_per_row[rows] + counts).max() > 10:
            continue
        ids = rng.integers(1, 1000, size=sum(counts))
        a.append_rows(rows, counts, ids)
        off = 0
        for r, c in zip(rows, counts):
            b.append_row(ids[off:off + c].tolist(), int(r))
            off += c
        assert np.array_equal(a.block_table_np, b.block_table_np)
        assert np.array_equal(a.kernel_block_table.np, b.kernel_block_table.np)
        assert np.array_equal(a.num_blocks_per_row, b.num_blocks_per_row)


def test_overflow_raises_and_changes_nothing():
    bt = BlockTable(4, 2, 3, 8)
    bt.add_row([1, 2], 0)
    before = (bt.block_table_np.copy(), bt.num_blocks_per_row.copy())
    with pytest.raises(MetadataError, match="max_num_blocks_per_req"):
        bt.append_row([3, 4], 0)
    with pytest.raises(MetadataError):
        bt.append_rows(np.array([0, 1]), np.array([2, 1]), np.array([5, 6, 7]))
    with pytest.raises(MetadataError):
        bt.add_row([1, 2, 3, 4], 1)
    assert np.array_equal(bt.block_table_np, before[0]) and np.array_equal(bt.num_blocks_per_row, before[1])


def test_bad_sizes_are_rejected():
    with pytest.raises(KVCacheSpecError, match="not a multiple"):
        BlockTable(24, 2, 2, 8, kernel_block_size=16)
    with pytest.raises(KVCacheSpecError):
        BlockTable(0, 2, 2, 8)
    with pytest.raises(KVCacheSpecError, match="one per group"):
        MultiGroupBlockTable([16, 32], 2, 64, 8, kernel_block_sizes=[16])


def test_commit_on_cpu_aliases_the_host_buffer():
    bt = BlockTable(32, 3, 4, 8, kernel_block_size=16)
    bt.add_row([1, 2], 0)
    bt.add_row([3], 1)
    bt.commit(2)
    t = bt.get_device_tensor(2)
    assert t.dtype == torch.int32 and t.shape == (2, 8) and t.device.type == "cpu"
    assert t[0].tolist() == [2, 3, 4, 5, 0, 0, 0, 0] and t[1].tolist() == [6, 7, 0, 0, 0, 0, 0, 0]
    assert t.data_ptr() == bt.kernel_block_table.cpu.data_ptr()  # no copy on a CPU device


def test_multigroup_forwards_row_operations_to_every_group():
    mg = MultiGroupBlockTable([4, 32], max_num_reqs=3, max_model_len=64, max_num_batched_tokens=8,
                              kernel_block_sizes=[4, 16])
    assert [bt.max_num_blocks_per_req for bt in mg] == [16, 2]
    mg.add_row(([1, 2, 3], [4]), 0)
    mg.add_row(([5], [6]), 2)
    mg.append_row(([7], [8]), 0)
    mg.move_row(2, 1)
    mg.clear_row(2)
    mg.swap_row(0, 1)
    assert mg[0].row_block_ids(0) == [5] and mg[1].row_block_ids(0) == [6]
    assert mg[0].row_block_ids(1) == [1, 2, 3, 7] and mg[1].row_block_ids(1) == [4, 8]
    assert mg.num_blocks_per_row.tolist() == [[1, 4, 0], [1, 2, 0]]
    # the 2-D counts array is the per-group count view
    assert mg.num_blocks_per_row[1] is not None and np.shares_memory(mg.num_blocks_per_row[1], mg[1].num_blocks_per_row)
    assert mg[1].kernel_block_table.np[1].tolist() == [8, 9, 16, 17]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
def test_commit_copies_the_valid_prefix_to_the_device():
    bt = BlockTable(32, 4, 4, 8, device="cuda", kernel_block_size=16)
    bt.add_row([1, 2], 0)
    bt.add_row([3], 1)
    bt.add_row([9], 3)
    bt.commit(2)
    dev = bt.kernel_block_table.gpu
    assert dev.device.type == "cuda" and bt.kernel_block_table.cpu.is_pinned()
    assert dev[:2].cpu().tolist() == [[2, 3, 4, 5, 0, 0, 0, 0], [6, 7, 0, 0, 0, 0, 0, 0]]
    assert dev[3].cpu().tolist() == [0] * 8  # rows past num_reqs are not copied
