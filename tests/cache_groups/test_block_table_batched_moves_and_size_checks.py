"""BlockTable / MultiGroupBlockTable at the edges mutation testing found untested: batched
row moves and single-row writes with kernel blocks, the decode slot mapping (``req_indices
None``) and precomputed block indices, every size check and its message, and the
multi-group forwarding of the batched operations. Module-level: no ATTNPLUG_VALIDATE."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attnplug.cache_groups.block_table import BlockTable, MultiGroupBlockTable, expand_to_kernel_block_ids
from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.errors import KVCacheSpecError, MetadataError

sys.path.insert(0, str(Path(__file__).parent))
from test_block_table import assert_consistent  # noqa: E402


@pytest.fixture(autouse=True)
def _no_validate(monkeypatch):
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


@pytest.mark.parametrize("block_size, kernel", [(4, 4), (8, 2)])
def test_batched_moves_copy_rows_of_any_length(block_size, kernel):
    bt = BlockTable(block_size, 6, 5, 16, kernel_block_size=kernel)
    rows = {0: [1, 2, 3, 4], 1: [5], 2: [6, 7], 3: [8, 9, 10, 11, 12]}
    for r, ids in rows.items():
        bt.add_row(ids, r)
    bt.move_rows(np.array([1, 2]), np.array([3, 4]))  # short rows over a long row and an empty one
    rows[3], rows[4] = list(rows[1]), list(rows[2])
    assert_consistent(bt, rows)
    bt.move_rows(np.array([0]), np.array([5]))  # a long row over an empty one
    rows[5] = list(rows[0])
    assert_consistent(bt, rows)
    bt.move_rows(np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert_consistent(bt, rows)
    bt.clear_row(1)
    bt.clear_row(3)
    rows.pop(1), rows.pop(3)
    bt.move_rows(np.array([1]), np.array([3]))  # empty over empty
    assert_consistent(bt, rows)
    bt.swap_row(0, 2)  # a long row with a short one
    rows[0], rows[2] = rows[2], rows[0]
    assert_consistent(bt, rows)
    bt.swap_row(1, 3)  # two empty rows
    assert_consistent(bt, rows)


@pytest.mark.parametrize("block_size, kernel", [(3, 3), (3, 1), (4, 2)])  # k = 1, 3, 2
def test_single_row_writes_expand_every_kernel_block(block_size, kernel):
    bt = BlockTable(block_size, 3, 4, 8, kernel_block_size=kernel)
    k = block_size // kernel
    bt.fill_vacant_row(np.array([4, 2], dtype=np.int32), 1)
    assert_consistent(bt, {1: [4, 2]})
    bt.append_row([7], 1)
    bt.append_rows(np.array([2, 0]), np.array([1, 2]), np.array([9, 5, 6]))
    assert_consistent(bt, {0: [5, 6], 1: [4, 2, 7], 2: [9]})
    bt.append_rows(np.array([0, 2]), np.array([1, 1]), np.array([11, 12]))  # one each: the decode path
    bt.append_rows(np.array([], dtype=np.int64), np.array([], dtype=np.int64), np.array([], dtype=np.int32))
    assert_consistent(bt, {0: [5, 6, 11], 1: [4, 2, 7], 2: [9, 12]})
    bt.write_blocks(np.array([2]), np.array([3]), np.array([13], dtype=np.int32))  # unchecked, no count
    assert bt.block_table_np[2, 3] == 13 and bt.num_blocks_per_row[2] == 2
    assert bt.kernel_block_table.np[2, 3 * k:].tolist() == list(range(13 * k, 14 * k))
    ids = bt.row_block_ids(0)
    ids.append(99)  # a fresh list
    assert bt.row_block_ids(0) == [5, 6, 11]


def test_slot_mapping_of_a_decode_step_and_with_precomputed_indices():
    bt = BlockTable(4, 4, 3, 8)
    for r, ids in enumerate([[1, 2], [5], [3, 6, 4]]):
        bt.add_row(ids, r)
    pos = np.array([5, 2, 9], dtype=np.int64)  # one token per row: token t is row t
    assert bt.compute_slot_mapping(None, pos).tolist() == [2 * 4 + 1, 5 * 4 + 2, 4 * 4 + 1]
    assert bt.compute_slot_mapping(None, pos, 5).tolist() == [9, 22, 17, PAD_SLOT_ID, PAD_SLOT_ID]
    req = np.array([2, 2, 0], dtype=np.int64)
    got = bt.compute_slot_mapping(req, np.array([0, 9, 4]), block_index=np.array([0, 2, 1]),
                                  block_offset=np.array([0, 1, 0]))
    assert got.tolist() == [3 * 4, 4 * 4 + 1, 2 * 4]
    assert got.dtype == torch.int64
    assert bt.compute_slot_mapping(req, np.array([1, 2, 3]), 3).tolist() == [13, 14, 7]  # no padding needed


@pytest.mark.parametrize("name, index", [("block_size", 0), ("kernel_block_size", 5), ("max_num_reqs", 1),
                                         ("max_num_blocks_per_req", 2), ("max_num_batched_tokens", 3)])
@pytest.mark.parametrize("bad", [0, -2, 2.0, None])
def test_each_size_must_be_a_positive_int(name, index, bad):
    args = [4, 2, 2, 8]
    kw = {}
    if index == 5:
        kw["kernel_block_size"] = bad
        if bad is None:  # None: the manager block size
            assert BlockTable(*args, **kw).kernel_block_size == 4
            return
    else:
        args[index] = bad
    with pytest.raises(KVCacheSpecError, match=exactly(f"BlockTable: {name} must be a positive int, got {bad!r}")):
        BlockTable(*args, **kw)


def test_sizes_of_one_and_numpy_ints_are_fine():
    bt = BlockTable(np.int64(1), 1, 1, 1)
    bt.add_row([3], 0)
    assert bt.compute_slot_mapping(np.array([0]), np.array([0])).tolist() == [3]


def test_size_messages():
    with pytest.raises(KVCacheSpecError, match=exactly(
            "manager block_size 24 is not a multiple of kernel_block_size 16: a manager block must split into "
            "whole kernel blocks; pick a kernel block size that divides the manager block size")):
        BlockTable(24, 2, 2, 8, kernel_block_size=16)
    bt = BlockTable(4, 2, 3, 8)
    bt.add_row([1, 2], 0)
    msg = ("block table row {} would hold {} blocks but max_num_blocks_per_req is 3: a request cannot own more "
           "than cdiv(max_model_len, block_size) blocks; check the block ids sent for it")
    with pytest.raises(MetadataError, match=exactly(msg.format(0, 4))):
        bt.append_row([3, 4], 0)
    with pytest.raises(MetadataError, match=exactly(msg.format(1, 4))):  # the first row that overflows
        bt.append_rows(np.array([0, 1]), np.array([1, 4]), np.array([5, 6, 7, 8, 9]))
    bt.append_rows(np.array([0, 1]), np.array([1, 3]), np.array([5, 6, 7, 8]))  # exactly full is fine
    assert bt.num_blocks_per_row.tolist() == [3, 3]
    with pytest.raises(MetadataError, match=exactly(msg.format(1, 4))):
        bt.add_row([1, 2, 3, 4], 1)
    with pytest.raises(KVCacheSpecError, match=exactly("MultiGroupBlockTable needs at least one cache group")):
        MultiGroupBlockTable([], 2, 64, 8)
    with pytest.raises(KVCacheSpecError, match=exactly("1 kernel block sizes for 2 cache groups: give one per group")):
        MultiGroupBlockTable([16, 32], 2, 64, 8, kernel_block_sizes=[16])


def test_multigroup_forwards_the_batched_operations():
    mg = MultiGroupBlockTable([4, 32], max_num_reqs=4, max_model_len=65, max_num_batched_tokens=8)
    assert len(mg) == 2 and [bt.max_num_blocks_per_req for bt in mg] == [17, 3]  # cdiv(65, B)
    assert [bt.kernel_block_size for bt in mg] == [4, 32]
    mg.add_row(([1, 2], [3]), 0)
    mg.add_row(([4], [5, 6]), 1)
    mg.move_rows(np.array([0, 1]), np.array([2, 3]))
    assert [mg[g].row_block_ids(r) for g in (0, 1) for r in (2, 3)] == [[1, 2], [4], [3], [5, 6]]
    mg.clear_rows([0, 3])
    assert mg.num_blocks_per_row.tolist() == [[0, 1, 2, 0], [0, 2, 1, 0]]
    mg.commit(3)
    assert mg[1].get_device_tensor(3).tolist() == [[0, 0, 0], [5, 6, 0], [3, 0, 0]]


def test_slots_past_int32_are_computed_in_int64():
    # block 2**24 of 256 tokens: its slots start at 2**32
    bt = BlockTable(256, 2, 2, 4)
    bt.add_row([1 << 24, 3], 1)
    got = bt.compute_slot_mapping(np.array([1, 1]), np.array([5, 300]))
    assert got.tolist() == [(1 << 32) + 5, 3 * 256 + 44]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_tables_are_int32_and_start_null_with_padded_slots(k):
    for ids in ([3, 0, 5], np.array([3, 0, 5], dtype=np.int64)):
        out = expand_to_kernel_block_ids(ids, k)
        assert out.dtype == np.int32 and out.tolist() == [x for b in (3, 0, 5) for x in
                                                          ([0] * k if b == 0 else range(b * k, b * k + k))]
    bt = BlockTable(4 * k, 3, 2, 5, kernel_block_size=4)
    assert bt.block_table_np.dtype == np.int32 and bt.kernel_block_table.np.dtype == np.int32
    assert (bt.block_table_np == NULL_BLOCK_ID).all() and (bt.kernel_block_table.np == NULL_BLOCK_ID).all()
    assert bt.slot_mapping.np.dtype == np.int64 and (bt.slot_mapping.np == PAD_SLOT_ID).all()
