"""``attnplug.core.validate`` on crafted bad batches, one check at a time.

Each test breaks exactly one thing in an otherwise consistent step and asserts the exact
invariant, row and values reported, so a check weakened (or only reachable through a path
that rejects the input earlier) fails here. Each branch of each invariant has a case;
consistent variants that must pass (null sliding-window blocks, manager blocks of several
kernel blocks, trailing entries past ``num_reqs``) are checked too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.errors import MetadataInvariantError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.validation import BatchView, RowState, validate

B = 4
BLOCKS = [[1, 2, 0], [5, 0, 0], [3, 6, 4]]
TOKENS = {"A": list(range(100, 106)), "B": list(range(200, 205)), "C": list(range(300, 310))}
COMPUTED, SCHEDULED, HELD = [5, 0, 8], [1, 3, 2], [6, 5, 10]
SAMPLING = {"A": (0.0, 0, 1.0), "B": (0.7, 5, 0.9), "C": (1.0, 0, 0.5)}


def case():
    """Three requests A (decode), B (partial prefill), C (2 tokens), consistent everywhere."""
    cm = CommonAttentionMetadata.from_lengths(COMPUTED, SCHEDULED, BLOCKS, B, num_prompt_tokens=HELD)
    table = np.zeros((4, 16), dtype=np.int32)
    for i, t in enumerate(TOKENS.values()):
        table[i, :len(t)] = t
    gens = {"B": torch.Generator().manual_seed(1), "C": torch.Generator().manual_seed(2)}
    states = {rid: RowState(rid, TOKENS[rid], c, ([b for b in BLOCKS[i] if b],), SAMPLING[rid], gens.get(rid))
              for i, (rid, c) in enumerate(zip("ABC", COMPUTED))}
    cols = [np.array([SAMPLING[r][k] for r in "ABC"] + [0], dtype=d)
            for k, d in enumerate((np.float32, np.int32, np.float32))]
    batch = BatchView(req_ids=["A", "B", "C"], req_id_to_index={"A": 0, "B": 1, "C": 2}, token_ids=table,
                      num_tokens=np.array(HELD + [0], dtype=np.int32),
                      num_computed_tokens=np.array(COMPUTED + [0], dtype=np.int32),
                      block_ids=[np.array(BLOCKS + [[0, 0, 0]], dtype=np.int32)],
                      num_blocks=[np.array([2, 1, 3, 0], dtype=np.int32)], states=states,
                      sampling=tuple(cols), generators={1: gens["B"], 2: gens["C"]})
    kw = dict(block_size=B, num_scheduled_tokens=list(SCHEDULED), num_tokens=list(HELD),
              discard=[False, True, False], batch=batch)
    return cm, kw


def fails(cm, kw, invariant: str, row, values=None, hint=None) -> MetadataInvariantError:
    with pytest.raises(MetadataInvariantError) as info:
        validate(cm, **kw)
    e = info.value
    assert (e.invariant, e.row) == (invariant, row), str(e)
    if values is not None:
        assert e.values == values, str(e)
    if hint is not None:  # the whole hint, as the message's last sentence
        assert str(e).endswith(f". {hint}"), str(e)
    return e


def test_the_crafted_step_is_consistent():
    cm, kw = case()
    validate(cm, **kw)
    validate(cm)  # without the optional inputs: only 4-6 and the padding part of 7


INV1 = "1 req_ids/req_id_to_index inverse"


def test_1_a_row_without_a_request():
    cm, kw = case()
    kw["batch"].req_ids = ["A", None, "C"]
    fails(cm, kw, INV1, 1, {"req_id": None, "req_id_to_index": None})
    kw["batch"].req_ids = ["A", "B"]  # fewer row ids than num_reqs
    fails(cm, kw, INV1, 2, {"req_id": None, "req_id_to_index": None})


def test_1_a_row_whose_request_maps_elsewhere():
    cm, kw = case()
    kw["batch"].req_id_to_index = {"A": 0, "B": 2, "C": 1}
    fails(cm, kw, INV1, 1, {"req_id": "B", "req_id_to_index": 2})


def test_1_a_mapped_request_whose_row_holds_another():
    cm, kw = case()
    kw["batch"].req_id_to_index = {"A": 0, "B": 1, "C": 2, "D": 1}
    fails(cm, kw, INV1, 1, {"req_id": "D", "req_ids_at_row": "B"})
    kw["batch"].req_id_to_index = {"A": 0, "B": 1, "C": 2, "D": 7}
    fails(cm, kw, INV1, 7, {"req_id": "D", "req_ids_at_row": None})


def test_1_more_mapped_requests_than_rows():
    cm, kw = case()
    kw["batch"].req_ids = ["A", "B", "C", "D"]
    kw["batch"].req_id_to_index = {"A": 0, "B": 1, "C": 2, "D": 3}
    fails(cm, kw, INV1, None, {"num_mapped": 4, "num_reqs": 3})


INV2 = "2 row columns"


@pytest.mark.parametrize("column, mutate, values", [
    ("num_tokens", lambda b: b.num_tokens.__setitem__(2, 9), {"batch": 9, "request": 10}),
    ("token_ids", lambda b: b.token_ids.__setitem__((2, 9), 1), {}),
    ("num_computed_tokens", lambda b: b.num_computed_tokens.__setitem__(2, 7), {"batch": 7, "request": 8}),
    ("block_table[group 0]", lambda b: b.block_ids[0].__setitem__((2, 2), 9),
     {"batch": [3, 6, 9], "request": [3, 6, 4]}),
    ("block_table[group 0]", lambda b: b.num_blocks[0].__setitem__(2, 2), {"batch": [3, 6], "request": [3, 6, 4]}),
    ("temperature", lambda b: b.sampling[0].__setitem__(2, 0.5), {"batch": 0.5, "request": 1.0}),
    ("top_k", lambda b: b.sampling[1].__setitem__(2, 3), {"batch": 3, "request": 0}),
    ("top_p", lambda b: b.sampling[2].__setitem__(2, 1.0), {"batch": 1.0, "request": 0.5}),
    ("generator", lambda b: b.generators.pop(2), {}),
], ids=["num_tokens", "token_ids", "computed", "block_id", "num_blocks", "temperature", "top_k", "top_p",
        "generator_missing"])
def test_2_each_column_of_a_row_belongs_to_its_request(column, mutate, values):
    cm, kw = case()
    mutate(kw["batch"])
    fails(cm, kw, INV2, 2, {"req_id": "C", "column": column, **values})


def test_2_generators_follow_their_requests():
    cm, kw = case()
    g = kw["batch"].generators
    g[1], g[2] = g[2], g[1]  # two seeded rows swapped their generators
    fails(cm, kw, INV2, 1, {"req_id": "B", "column": "generator"},
          hint="the row's generator is not its request's (a row move left it behind or swapped it)")
    cm, kw = case()
    kw["batch"].generators[0] = torch.Generator()  # an unseeded row holding a generator
    fails(cm, kw, INV2, 0, {"req_id": "A", "column": "generator"})


def test_2_skips_what_the_view_does_not_carry():
    cm, kw = case()
    b = kw["batch"]
    b.sampling[0][2], b.generators = 0.5, None
    b.states["C"].sampling = None  # the request does not say: the column is not checked
    validate(cm, **kw)
    b.states = {"A": b.states["A"]}  # rows without a state are not checked
    b.token_ids[2, 0] = 1
    validate(cm, **kw)
    b.states = {}
    validate(cm, **kw)


def test_3_token_count():
    cm, kw = case()
    kw["num_scheduled_tokens"] = [1, 3, 3]
    fails(cm, kw, "3 token count", None, {"sum_num_scheduled_tokens": 7, "num_actual_tokens": 6})
    cm, kw = case()
    kw["num_scheduled_tokens"] = SCHEDULED + [5]  # entries past num_reqs are not rows
    validate(cm, **kw)


INV4 = "4 query_start_loc"


def test_4_query_start_loc_each_check():
    cm, kw = case()
    kw.pop("num_scheduled_tokens")
    fails(cm.replace(query_start_loc_cpu=torch.tensor([0, 1, 4], dtype=torch.int32)), kw, INV4, None,
          {"length": 3, "num_reqs": 3})
    fails(cm.replace(query_start_loc_cpu=torch.tensor([1, 1, 4, 6], dtype=torch.int32)), kw, INV4, 0,
          {"query_start_loc_0": 1})
    fails(cm.replace(query_start_loc_cpu=torch.tensor([0, 4, 1, 6], dtype=torch.int32)), kw, INV4, 1,
          {"query_start_loc": [4, 1]}, hint="must be non-decreasing")
    fails(cm.replace(query_start_loc_cpu=torch.tensor([0, 1, 4, 5], dtype=torch.int32)), kw, INV4, 3,
          {"query_start_loc_last": 5, "num_actual_tokens": 6})


def test_4_query_lengths_match_the_schedule_row_by_row():
    cm, kw = case()
    kw["num_scheduled_tokens"] = [3, 1, 2]  # same total: invariant 3 holds, the rows do not
    fails(cm, kw, INV4, 0, {"query_len": 1, "num_scheduled_tokens": 3})


def test_5_positions():
    cm, kw = case()
    fails(cm.replace(positions=torch.tensor([5, 0, 1, 2, 8, 10])), kw, "5 positions", 2,
          {"token": 5, "position": 10, "expected": 9})
    validate(cm.replace(positions=None), **kw)


def test_6_seq_len_is_last_position_plus_one():
    cm, kw = case()
    fails(cm.replace(seq_lens_cpu=torch.tensor([6, 3, 11], dtype=torch.int32)), kw, "6 seq_lens", 2,
          {"seq_len": 11, "last_position_plus_1": 10})


def test_6_capacity_counts_to_the_last_non_null_block():
    cm, kw = case()
    short = cm.replace(block_table_tensor=torch.tensor([[1, 2, 0], [5, 0, 0], [3, 6, 0]], dtype=torch.int32))
    fails(short, kw, "6 seq_lens", 2, {"seq_len": 10, "capacity": 8, "block_size": B},
          hint="the block table row is too short")
    empty = cm.replace(block_table_tensor=torch.tensor([[1, 2, 0], [0, 0, 0], [3, 6, 4]], dtype=torch.int32))
    fails(empty, kw, "6 seq_lens", 1, {"seq_len": 3, "capacity": 0, "block_size": B})


INV7 = "7 slots"
SLOTS = [9, 20, 21, 22, 16, 17]  # A pos 5 -> block 2; B pos 0..2 -> block 5; C pos 8, 9 -> block 4


@pytest.mark.parametrize("token, slot, owned", [
    (3, 23, 5),    # B's position 2 written at offset 3 of its own block
    (1, 8, 5),     # B's position 0 in A's block 2
    (0, -1, -1),   # a real token with PAD_SLOT_ID
    (4, 2, 4),     # C's position 8 in the null block
], ids=["offset", "foreign_block", "pad_for_real", "null_block"])
def test_7_each_real_slot_lies_at_its_position_in_its_block(token, slot, owned):
    cm, kw = case()
    slots = list(SLOTS)
    slots[token] = slot
    row = [0, 1, 1, 1, 2, 2][token]
    fails(cm.replace(slot_mapping=torch.tensor(slots)), kw, INV7, row,
          {"token": token, "slot": slot, "position": [5, 0, 1, 2, 8, 9][token], "owned_block": owned},
          hint="slot must lie in the request's block for that position")


def test_7_padded_tokens_carry_pad_slot_id():
    cm, kw = case()
    fails(cm.replace(slot_mapping=torch.tensor(SLOTS + [PAD_SLOT_ID, 3])), kw, INV7, None,
          {"token": 7, "slot": 3}, hint="padded tokens must carry PAD_SLOT_ID")
    validate(cm.replace(slot_mapping=torch.tensor(SLOTS + [PAD_SLOT_ID] * 2)), **kw)


def _window_case(n: int, table: list[int], W: int):
    """One decode at position ``n`` of a request whose block row is ``table`` (kernel blocks of B)."""
    cm = CommonAttentionMetadata.from_lengths([n], [1], [table], B)
    return cm, dict(block_size=B, sliding_window=W)


def test_7_sliding_window_blocks_before_the_window_are_null_at_the_boundary():
    # W = 5, B = 4: after n computed tokens the first n - 4 tokens are never read again
    table = [0, 7, 8, 9, 10]
    cm, kw = _window_case(11, table, 5)
    validate(cm, **kw)  # 7 tokens gone: block 1 still holds a visible token
    cm, kw = _window_case(12, table, 5)  # n - W + 1 = 8 = 2 * B: block 1 is wholly before the window
    fails(cm, kw, INV7, 0, {"kernel_block_index": 1, "block": 7, "num_computed_tokens": 12, "sliding_window": 5},
          hint="blocks before the window were freed and must be null")
    validate(cm.replace(block_table_tensor=torch.tensor([[0, 0, 8, 9, 10]], dtype=torch.int32)), **kw)


def test_7_sliding_window_counts_whole_manager_blocks():
    # manager blocks of 8 tokens = 2 kernel blocks of 4; n = 16, W = 4: 13 tokens gone, one whole
    # manager block (kernel blocks 0 and 1); kernel block 2 belongs to a manager block still in use
    cm, kw = _window_case(16, [0, 0, 5, 6, 7], 4)
    validate(cm, **kw, manager_block_size=8)
    fails(cm, kw, INV7, 0, {"kernel_block_index": 2, "block": 5, "num_computed_tokens": 16, "sliding_window": 4})


def test_8_discard_exactly_the_partial_prefills():
    cm, kw = case()
    kw["discard"] = [False, False, False]
    fails(cm, kw, "8 discard", 1, {"discard": False, "seq_len": 3, "num_tokens": 5})
    kw["discard"] = [True, True, False]
    fails(cm, kw, "8 discard", 0, {"discard": True, "seq_len": 6, "num_tokens": 6})
    kw.pop("num_tokens")
    validate(cm, **kw)  # without num_tokens the mask is not checked

