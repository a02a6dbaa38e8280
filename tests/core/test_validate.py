"""validate(): each of the eight invariants raises MetadataInvariantError naming it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.errors import MetadataInvariantError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.validation import BatchView, RowState, validate

BLOCKS = [[1, 2, 0], [5, 0, 0], [3, 6, 4]]
TOKENS = {"A": list(range(100, 106)), "B": list(range(200, 205)), "C": list(range(300, 310))}


def seed_case():
    """The seed's example, consistent in every column."""
    cm = CommonAttentionMetadata.from_lengths([5, 0, 8], [1, 3, 2], BLOCKS, 4, num_prompt_tokens=[6, 5, 10])
    table = np.zeros((3, 16), dtype=np.int32)
    for i, t in enumerate(TOKENS.values()):
        table[i, :len(t)] = t
    nb = np.array([2, 1, 3], dtype=np.int32)
    states = {rid: RowState(rid, TOKENS[rid], c, ([b for b in BLOCKS[i] if b],))
              for i, (rid, c) in enumerate(zip("ABC", [5, 0, 8]))}
    batch = BatchView(req_ids=["A", "B", "C"], req_id_to_index={"A": 0, "B": 1, "C": 2}, token_ids=table,
                      num_tokens=np.array([6, 5, 10], dtype=np.int32),
                      num_computed_tokens=np.array([5, 0, 8], dtype=np.int32),
                      block_ids=[np.array(BLOCKS, dtype=np.int32)], num_blocks=[nb], states=states)
    kw = dict(block_size=4, num_scheduled_tokens=[1, 3, 2], num_tokens=[6, 5, 10],
              discard=[False, True, False], batch=batch)
    return cm, kw


def fails(inv: str, cm, **kw) -> MetadataInvariantError:
    with pytest.raises(MetadataInvariantError) as info:
        validate(cm, **kw)
    assert info.value.invariant.startswith(inv), str(info.value)
    assert f"invariant {info.value.invariant}" in str(info.value)
    return info.value


def test_a_consistent_step_passes():
    cm, kw = seed_case()
    validate(cm, **kw)


def test_1_inverse_maps():
    cm, kw = seed_case()
    kw["batch"].req_id_to_index = {"A": 0, "B": 2, "C": 1}
    assert fails("1", cm, **kw).row == 1


def test_2_every_column_of_a_row_belongs_to_one_request():
    cm, kw = seed_case()
    kw["batch"].token_ids[1, 2] = 999  # B's token history carries someone else's token
    e = fails("2", cm, **kw)
    assert e.row == 1 and e.values["column"] == "token_ids"
    cm, kw = seed_case()
    kw["batch"].block_ids[0][2, 1] = 7  # C's block row does not match C's blocks
    assert fails("2", cm, **kw).values["column"] == "block_table[group 0]"


def test_3_token_count():
    cm, kw = seed_case()
    kw["num_scheduled_tokens"] = [1, 3, 3]
    assert fails("3", cm, **kw).values["num_actual_tokens"] == 6


def test_4_query_start_loc():
    cm, kw = seed_case()
    kw.pop("num_scheduled_tokens")
    bad = cm.replace(query_start_loc_cpu=torch.tensor([0, 4, 1, 6], dtype=torch.int32))
    assert fails("4", bad, **kw).row == 1  # decreasing
    bad = cm.replace(query_start_loc_cpu=torch.tensor([1, 1, 4, 6], dtype=torch.int32))
    assert fails("4", bad, **kw).row == 0


def test_5_positions():
    cm, kw = seed_case()
    bad = cm.replace(positions=torch.tensor([5, 0, 1, 3, 8, 9]))
    e = fails("5", bad, **kw)
    assert e.row == 1 and e.values == {"token": 3, "position": 3, "expected": 2}


def test_6_seq_lens_capacity_and_last_position():
    cm, kw = seed_case()
    short = cm.replace(block_table_tensor=torch.tensor([[1, 2, 0], [5, 0, 0], [3, 6, 0]], dtype=torch.int32))
    e = fails("6", short, **kw)
    assert e.row == 2 and e.values["capacity"] == 8 and e.values["seq_len"] == 10
    bad = cm.replace(seq_lens_cpu=torch.tensor([6, 3, 11], dtype=torch.int32))
    assert fails("6", bad, **kw).row == 2


def test_7_slots_lie_in_the_requests_blocks_and_padding_is_pad():
    cm, kw = seed_case()
    stolen = cm.replace(slot_mapping=torch.tensor([9, 8, 21, 22, 16, 17]))  # B writes into A's block 2
    e = fails("7", stolen, **kw)
    assert e.row == 1 and e.values["slot"] == 8
    padded = cm.replace(slot_mapping=torch.tensor([9, 20, 21, 22, 16, 17, PAD_SLOT_ID, 3]))
    assert fails("7", padded, **kw).values["token"] == 7


def test_8_partial_prefill_logits_are_discarded():
    cm, kw = seed_case()
    kw["discard"] = [False, False, False]
    e = fails("8", cm, **kw)
    assert e.row == 1 and e.values == {"discard": False, "seq_len": 3, "num_tokens": 5}
