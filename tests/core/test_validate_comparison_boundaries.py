"""``attnplug.core.validate`` at the edges the first crafted batches did not reach.

Found by mutation testing (docs/mutation-testing.md): the boundaries of each comparison (a row
exactly at capacity, a zero-length query, a slot of 0, a window at ``n - W + 1 ≡ 3 (mod
B)``, block size 1), the visible-block half of the sliding-window check, the Mamba
state-group check, and the exact message of a failure without a hint. Each test breaks one
thing in a consistent step (or keeps one consistent at the boundary) and asserts the
invariant, row, values and hint reported."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attnplug.core.errors import MetadataInvariantError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.validation import validate

sys.path.insert(0, str(Path(__file__).parent))
from test_validate_invariants import INV1, INV2, INV4, INV7, case, fails  # noqa: E402

WINDOW_HINT = "blocks before the window were freed and must be null"
VISIBLE_HINT = "a block this step's queries can see is the null block"
STATE_HINT = "a Mamba state group's request must hold a real state slot (column 0)"


def test_a_failure_without_a_hint_has_exactly_the_invariant_row_and_values():
    cm, kw = case()
    kw["discard"] = [False, False, False]
    with pytest.raises(MetadataInvariantError) as info:
        validate(cm, **kw)
    assert str(info.value) == "invariant 8 discard violated at row 1: discard=False, seq_len=3, num_tokens=5"


def test_1_the_mapped_row_may_be_one_past_the_last_row_id():
    cm, kw = case()
    kw["batch"].req_id_to_index = {"A": 0, "B": 1, "C": 2, "D": 3}  # row 3 == len(req_ids)
    fails(cm, kw, INV1, 3, {"req_id": "D", "req_ids_at_row": None})


def test_1_a_row_without_a_request_reports_no_mapping_even_for_a_none_key():
    cm, kw = case()
    kw["batch"].req_ids = ["A", None, "C"]
    kw["batch"].req_id_to_index = {"A": 0, None: 1, "C": 2}
    fails(cm, kw, INV1, 1, {"req_id": None, "req_id_to_index": None})


def test_2_rows_after_one_without_a_state_are_still_checked():
    cm, kw = case()
    b = kw["batch"]
    b.states = {"C": b.states["C"]}  # rows 0 and 1 carry no state
    b.token_ids[2, 0] = 1
    fails(cm, kw, INV2, 2, {"req_id": "C", "column": "token_ids"})
    b.states = None  # no states at all: nothing to compare
    validate(cm, **kw)


def test_4_zero_length_queries_are_non_decreasing():
    # padded request rows (CUDA graphs) repeat the last offset: query length 0
    cm, kw = case()
    qsl = cm.query_start_loc_cpu.tolist()
    validate(cm.replace(query_start_loc_cpu=torch.tensor(qsl + [qsl[-1]] * 2, dtype=torch.int32)), **kw)
    kw.pop("num_scheduled_tokens")
    # a zero-length query before the decreasing step: the first *decreasing* pair is reported
    fails(cm.replace(query_start_loc_cpu=torch.tensor([0, 0, 7, 6], dtype=torch.int32)), kw, INV4, 2,
          {"query_start_loc": [7, 6]}, hint="must be non-decreasing")


def test_4_the_first_offset_is_reported():
    cm, kw = case()
    kw.pop("num_scheduled_tokens")
    fails(cm.replace(query_start_loc_cpu=torch.tensor([1, 2, 4, 6], dtype=torch.int32)), kw, INV4, 0,
          {"query_start_loc_0": 1})


def test_5_positions_are_reported_as_int64():
    cm, kw = case()
    big = (1 << 53) + 1  # not a float64
    fails(cm.replace(positions=torch.tensor([5, 0, 1, 2, 8, big])), kw, "5 positions", 2,
          {"token": 5, "position": big, "expected": 9})


def test_6_a_row_filled_exactly_to_capacity_is_fine():
    # one decode at position 7: seq_len 8 == 2 blocks of 4
    cm = CommonAttentionMetadata.from_lengths([7], [1], [[3, 4, 0]], 4)
    validate(cm, block_size=4)
    # a lone block at the start of a wide row: capacity counts up to it, not the row's width
    cm = CommonAttentionMetadata.from_lengths([4], [1], [[5, 6, 0, 0]], 4)
    fails(cm.replace(block_table_tensor=torch.tensor([[5, 0, 0, 0]], dtype=torch.int32)), {"block_size": 4},
          "6 seq_lens", 0, {"seq_len": 5, "capacity": 4, "block_size": 4}, hint="the block table row is too short")


def test_7_slot_zero_is_in_the_null_block():
    cm, kw = case()
    slots = [9, 20, 21, 22, 16, 17]
    slots[1] = 0  # B's position 0 at slot 0: the null block, offset 0
    fails(cm.replace(slot_mapping=torch.tensor(slots)), kw, INV7, 1,
          {"token": 1, "slot": 0, "position": 0, "owned_block": 5})


def test_7_slots_are_compared_as_int64():
    # block 2**30 of 2**23 tokens: slot 2**53 + 1 (not a float64)
    B = 1 << 23
    cm = CommonAttentionMetadata.from_lengths([1], [1], [[1 << 30]], B)
    assert cm.slot_mapping.tolist() == [(1 << 53) + 1]
    validate(cm, block_size=B)


def _window(n: int, table: list[int], W: int, B: int, query: int = 1):
    return CommonAttentionMetadata.from_lengths([n], [query], [table], B), {"block_size": B, "sliding_window": W}


def test_7_a_visible_block_must_be_real():
    # W = 5, B = 4, n = 11: keys 7.. are visible, so kernel block 1 (tokens 4..7) is still read
    cm, kw = _window(11, [0, 7, 8, 0], 5, 4)
    validate(cm, **kw)  # block 3, past the last position, may be null
    cm, kw = _window(11, [0, 0, 8, 0], 5, 4)
    fails(cm, kw, INV7, 0, {"kernel_block_index": 1, "num_computed_tokens": 11, "sliding_window": 5},
          hint=VISIBLE_HINT)


def test_7_the_last_visible_block_of_a_row_with_no_query_must_be_real():
    # a zero-length query at n = 9: the last key (position 8) is in block 2, which no slot covers
    cm, kw = _window(9, [0, 7, 6], 5, 4, query=0)
    validate(cm, **kw)
    cm, kw = _window(9, [0, 7, 0, 5], 5, 4, query=0)  # block 3 keeps the capacity (invariant 6)
    fails(cm, kw, INV7, 0, {"kernel_block_index": 2, "num_computed_tokens": 9, "sliding_window": 5},
          hint=VISIBLE_HINT)


def test_7_block_size_one_before_the_window_fills():
    # n = 2 < W = 5: nothing is skipped; every earlier token is still visible
    cm, kw = _window(2, [7, 8, 9], 5, 1)
    validate(cm, **kw)
    cm, kw = _window(2, [0, 8, 9], 5, 1)
    fails(cm, kw, INV7, 0, {"kernel_block_index": 0, "num_computed_tokens": 2, "sliding_window": 5},
          hint=VISIBLE_HINT)


def test_7_skipped_manager_blocks_of_several_kernel_blocks_must_be_null():
    # manager blocks of 8 = 2 kernel blocks of 4; n = 16, W = 4: manager block 0 (kernel 0, 1) is freed
    cm, kw = _window(16, [0, 4, 5, 6, 7], 4, 4)
    fails(cm, {**kw, "manager_block_size": 8}, INV7, 0,
          {"kernel_block_index": 1, "block": 4, "num_computed_tokens": 16, "sliding_window": 4}, hint=WINDOW_HINT)


def _state_case(table: torch.Tensor):
    cm = CommonAttentionMetadata.from_lengths([4, 0, 2], [1, 3, 1], [[1], [1], [1]], 16)
    return cm.replace(block_table_tensor=table), {"state_group": True}


def test_7_a_state_group_row_holds_a_real_state_slot():
    cm, kw = _state_case(torch.tensor([[3, 0], [2, 0], [5, 0]], dtype=torch.int32))
    validate(cm, **kw)
    cm, kw = _state_case(torch.tensor([[3, 9], [0, 9], [5, 9]], dtype=torch.int32))
    fails(cm, kw, INV7, 1, {}, hint=STATE_HINT)
    cm, kw = _state_case(torch.zeros((3, 0), dtype=torch.int32))  # no column at all
    fails(cm, kw, INV7, 0, {}, hint=STATE_HINT)
    validate(cm, state_group=False)


def test_8_any_true_value_of_the_mask_means_discarded():
    cm, kw = case()
    kw["discard"] = np.array([0, 2, 0], dtype=np.int8)
    validate(cm, **kw)

