"""The seed's worked examples (the seed document, `../shared/seed/`), exactly: through ``attnplug explain`` (the
shipped files under docs/examples) and through the StepCompiler API."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from attnplug.runner.commands.explain import run
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.request_state import CachedRequestState
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from attnplug.runner.step.compiler import StepCompiler

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"


def explain(name: str) -> list[dict]:
    out, err = io.StringIO(), io.StringIO()
    with open(EXAMPLES / name) as f:
        rc = run(f, out, err, check=True)
    assert rc == 0, err.getvalue()
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_example_1_query_start_loc_through_explain():
    (step,) = explain("seed_query_start_loc.jsonl")
    assert step["num_scheduled_tokens"] == [2, 5, 3]
    assert step["query_start_loc"] == [0, 2, 7, 10]
    assert step["positions"] == [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]  # == query_pos: nothing computed yet
    assert step["logits_indices"] == [1, 6, 9]


def test_example_1_req_indices_and_query_pos_through_the_api():
    sc = StepCompiler([4], 8, 64, 64, validate=True)
    so = SchedulerOutput([NewRequestData("A", [10, 11], ([1],)),
                          NewRequestData("B", [20, 21, 22, 23, 24], ([2, 3],)),
                          NewRequestData("C", [30, 31, 32], ([4],))], CachedRequestData(),
                         {"A": 2, "B": 5, "C": 3})
    sc.update_states(so)
    inp = sc.prepare_inputs(so)
    assert inp.query_start_loc.tolist() == [0, 2, 7, 10]
    assert inp.req_indices.tolist() == [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
    assert inp.positions.tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
    assert inp.logits_indices.tolist() == [1, 6, 9]


SEED2 = {
    "req_ids": ["A", "B", "C"],
    "num_scheduled_tokens": [1, 3, 2],
    "num_computed_tokens": [5, 0, 8],
    "query_start_loc": [0, 1, 4, 6],
    "positions": [5, 0, 1, 2, 8, 9],
    "input_ids": [105, 200, 201, 202, 308, 309],  # a5, b0, b1, b2, c8, c9
    "seq_lens": [6, 3, 10],
    "slot_mapping": [[9, 20, 21, 22, 16, 17]],
    "logits_indices": [0, 3, 5],
    "discard": [False, True, False],  # B's prompt (5 tokens) is longer than its 3-token chunk
    "block_table": [[[1, 2], [5], [3, 6, 4]]],
    "num_actual_tokens": 6, "max_query_len": 3, "max_seq_len": 10, "common_prefix_len": [0],
}


def test_example_2_slot_mapping_through_explain():
    (step,) = explain("seed_slot_mapping.jsonl")
    assert step == SEED2


def test_example_2_through_the_api():
    sc = StepCompiler([4], 8, 64, 64, validate=True)
    so = SchedulerOutput([NewRequestData("A", list(range(100, 106)), ([1, 2],), 5),
                          NewRequestData("B", list(range(200, 205)), ([5],), 0),
                          NewRequestData("C", list(range(300, 310)), ([3, 6, 4],), 8)],
                         CachedRequestData(), {"A": 1, "B": 3, "C": 2})
    sc.update_states(so)
    inp = sc.prepare_inputs(so)
    assert inp.req_ids == SEED2["req_ids"]
    assert inp.req_indices.tolist() == [0, 1, 1, 1, 2, 2]
    assert (inp.positions.numpy() - inp.num_computed_tokens[inp.req_indices]).tolist() == [0, 0, 1, 2, 0, 1]
    for key in ("query_start_loc", "positions", "input_ids", "seq_lens", "logits_indices"):
        assert getattr(inp, key).tolist() == SEED2[key], key
    assert inp.slot_mapping[0].tolist() == SEED2["slot_mapping"][0]
    assert inp.discard.tolist() == SEED2["discard"]
    # visible key length of query j of request i is c_i + j + 1: A 6; B 1, 2, 3; C 9, 10
    assert (inp.positions + 1).tolist() == [6, 1, 2, 3, 9, 10]
    cm = inp.common_attn_metadata[0]
    assert cm.query_start_loc.tolist() == [0, 1, 4, 6] and cm.seq_lens.tolist() == [6, 3, 10]
    assert cm.num_reqs == 3 and cm.num_actual_tokens == 6 and cm.max_query_len == 3 and cm.max_seq_len == 10
    assert cm.is_prefilling.tolist() == [True, True, True]  # A and C have uncomputed prompt tokens too


def test_example_3_condense_through_explain():
    first, second = explain("seed_condense.jsonl")
    assert first["req_ids"] == ["A", "B", "C", "D"]
    assert second["req_ids"] == ["A", "D", "C"]
    assert second["block_table"] == [[[1], [4], [3]]]  # D's block row moved with it
    assert second["input_ids"] == [12, 42, 32]


def test_example_3_condense_through_the_input_batch():
    batch = InputBatch(4, 16, 16, [4])
    for rid, blk, temp in (("A", 1, 0.1), ("B", 2, 0.2), ("C", 3, 0.3), ("D", 4, 0.4)):
        from attnplug.runner.step.scheduler_output import SamplingParams
        batch.add_request(CachedRequestState(rid, [blk * 10, blk * 10 + 1], ([blk],), 1,
                                             SamplingParams(temperature=temp)))
    assert batch.req_ids == ["A", "B", "C", "D"]
    batch.remove_request("B")
    assert batch.condense() == [(3, 1)]
    assert batch.req_ids == ["A", "D", "C"]
    assert batch.req_id_to_index == {"A": 0, "D": 1, "C": 2}
    # every column of the row moved with D (not only _req_ids)
    assert batch.token_ids_cpu[1, :2].tolist() == [40, 41]
    assert batch.temperature[1] == np.float32(0.4)
    assert batch.block_table[0].row_block_ids(1) == [4]


def test_example_4_manager_block_over_kernel_block_through_explain():
    (step,) = explain("seed_kernel_block_size.jsonl")
    assert step["block_table"] == [[[2, 3, 4, 5, 6, 7]]]  # manager [1, 2, 3] -> kernel b*2, b*2+1
    assert step["positions"] == [64, 65, 66, 67, 68, 69]
    assert step["slot_mapping"] == [[96, 97, 98, 99, 100, 101]]  # manager block 3 * 32 + offset


def test_example_4_through_the_api():
    sc = StepCompiler([32], 4, 128, 64, kernel_block_sizes=[16], validate=True)
    so = SchedulerOutput([NewRequestData("A", list(range(70)), ([1, 2, 3],), 64)], CachedRequestData(), {"A": 6})
    sc.update_states(so)
    inp = sc.prepare_inputs(so)
    assert inp.block_table_tensor[0][0].tolist() == [2, 3, 4, 5, 6, 7, 0, 0]
    assert sc.requests["A"].block_ids == ([1, 2, 3],)  # the object view keeps manager ids


def test_minimal_experiment_through_explain():
    _, step = explain("seed_minimal_experiment.jsonl")
    assert step["req_ids"] == ["A", "B"]
    assert step["num_scheduled_tokens"] == [1, 3]
    assert step["num_computed_tokens"] == [8, 0]
    assert step["query_start_loc"] == [0, 1, 4]
    assert step["positions"] == [8, 0, 1, 2]
    assert step["seq_lens"] == [9, 3]
    assert step["logits_indices"] == [0, 3]
    assert step["discard"] == [False, True]


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.jsonl")))
def test_every_shipped_example_passes_check(name):
    assert explain(name)
