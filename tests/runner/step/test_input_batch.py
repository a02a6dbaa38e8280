"""InputBatch: every per-row column moves together; the object view reads through rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.core.errors import MetadataError
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.request_state import CachedRequestState
from attnplug.runner.step.scheduler_output import SamplingParams


def state(i: int, seed=None) -> CachedRequestState:
    sp = SamplingParams(temperature=0.1 * i, top_k=i, top_p=1.0 - 0.01 * i, seed=seed)
    return CachedRequestState(f"r{i}", [i * 10 + t for t in range(i + 1)], ([i + 1], [i + 20, i + 30]),
                              num_computed_tokens=i, sampling_params=sp)


def row_signature(batch: InputBatch, row: int):
    st = batch.state_at(row)
    n = int(batch.num_tokens[row])
    return (batch._req_ids[row], st.req_id, st.row, batch.token_ids_cpu[row, :n].tolist(),
            [float(c[row]) for c in batch.row_columns], [bt.row_block_ids(row) for bt in batch.block_table],
            batch.generators.get(row))


def check_rows(batch: InputBatch, expected: dict[str, tuple]):
    assert batch.num_reqs == len(expected)
    for rid, sig in expected.items():
        row = batch.req_id_to_index[rid]
        got = row_signature(batch, row)
        assert got[0] == got[1] == rid and got[2] == row
        assert got[3:] == sig[3:], rid


def test_condense_and_swap_move_every_column():
    batch = InputBatch(6, 16, 16, [4, 8], kernel_block_sizes=[4, 4])
    states = [state(i, seed=i if i % 2 else None) for i in range(6)]
    batch.add_requests(states)
    sigs = {st.req_id: row_signature(batch, st.row) for st in states}
    for rid in ("r1", "r3"):
        batch.remove_request(rid)
        sigs.pop(rid)
    moves = batch.condense()
    assert moves == [(5, 1), (4, 3)]
    check_rows(batch, sigs)
    batch.swap_states(0, 3)
    check_rows(batch, sigs)
    assert batch.req_ids == ["r4", "r5", "r2", "r0"]
    # vacant rows hold no blocks: a new request's add is a plain write
    assert (batch.block_table.num_blocks_per_row[:, 4:] == 0).all()


def test_add_fills_the_lowest_hole_first():
    batch = InputBatch(4, 8, 8, [4])
    batch.add_requests([state(i) for i in range(4)])
    batch.remove_request("r2")
    batch.remove_request("r0")
    assert batch.next_free_rows(3) == [0, 2, 4]
    assert batch.add_request(state(5)) == 0
    assert batch.add_request(state(6)) == 2


def test_state_reads_through_its_row_and_keeps_values_when_it_leaves():
    batch = InputBatch(2, 8, 8, [4])
    st = state(2, seed=7)
    assert isinstance(st.generator, torch.Generator)
    batch.add_request(st)
    batch.num_computed_tokens_cpu[st.row] = 3
    batch.token_ids_cpu[st.row, 3] = 99
    batch.num_tokens[st.row] = 4
    batch.block_table[0].append_row([9], st.row)
    assert st.num_computed_tokens == 3 and st.output_token_ids == (99,)
    assert st.all_token_ids == [20, 21, 22, 99] and st.block_ids == ([3, 9],)
    batch.remove_request(st.req_id)  # unscheduled: the values are written back
    assert st.row is None and st.num_computed_tokens == 3 and st.all_token_ids == [20, 21, 22, 99]
    assert st.block_ids == ([3, 9],) and st.num_tokens == 4
    assert batch.add_request(st) == 0 and batch.token_ids_cpu[0, :4].tolist() == [20, 21, 22, 99]
    assert batch.generators[0] is st.generator


def test_add_refuses_duplicates_and_overflow_without_changes():
    batch = InputBatch(1, 4, 4, [4])
    batch.add_request(state(0))
    with pytest.raises(MetadataError, match="already in the batch"):
        batch.add_request(batch.state_at(0))
    with pytest.raises(MetadataError, match="free rows"):
        batch.add_request(state(1))
    with pytest.raises(MetadataError, match="max_model_len"):
        InputBatch(1, 2, 4, [4]).add_request(state(3))
    assert batch.req_ids == ["r0"] and batch.num_reqs == 1
    assert np.array_equal(batch.num_tokens[:1], [1])
