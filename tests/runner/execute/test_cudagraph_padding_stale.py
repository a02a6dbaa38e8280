"""CUDA-graph padding after a larger step: nothing of the larger step survives in the padded
rows. The step compiler's token buffers and PaddedMetadata's request buffers are persistent,
so a padded step that writes only its own prefix would leave the last step's seq_lens,
query lengths, block-table rows or slots in its padded rows. Every padded row is checked on
a sequence of shrinking steps (large, then smaller, both paths of the step compiler), and
every real row against the requests it holds; no ATTNPLUG_VALIDATE needed."""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.runner.execute.cudagraph import CUDAGraphDispatcher, CUDAGraphMode, PaddedMetadata, batch_shape
from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

BLOCK_SIZES = [4, 8]  # two groups: two slot mappings and block tables
MAX_REQS = 8
# (num_computed_tokens, num_scheduled_tokens) per request, and the padded (P, R_pad) expected
STEPS = [
    ([(5, 1), (0, 7), (9, 2), (3, 1), (0, 4)], (16, 8)),  # Q=15, R=5
    ([(2, 1), (0, 2), (6, 1)], (4, 4)),                    # Q=4: no token padding, row 3 padded
    ([(4, 1), (6, 1), (2, 1)], (4, 4)),                    # uniform decode: token 3 and row 3 padded
    ([(0, 5), (3, 2)], (8, 2)),                            # tokens 7 padded, no request padding
]


def _schedule(step: int, requests, prev_ids, next_block):
    """New requests ``s{step}r{i}`` (the previous step's requests finish); their block ids per group."""
    new, blocks = [], {}
    for i, (c, s) in enumerate(requests):
        rid = f"s{step}r{i}"
        ids = []
        for B in BLOCK_SIZES:
            n = -(-(c + s) // B)
            ids.append(list(range(next_block, next_block + n)))
            next_block += n
        blocks[rid] = ids
        new.append(NewRequestData(req_id=rid, prompt_token_ids=[7 + i] * (c + s + 1), block_ids=tuple(ids),
                                  num_computed_tokens=c))
    so = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData(),
                         num_scheduled_tokens={f"s{step}r{i}": s for i, (_, s) in enumerate(requests)},
                         total_num_scheduled_tokens=sum(s for _, s in requests), finished_req_ids=set(prev_ids))
    return so, blocks, next_block


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    NATIVE is None, reason="the compiled extension is not built"))], ids=["numpy", "native"])
def test_padded_rows_after_a_larger_step_hold_nothing_of_it(native):
    sc = StepCompiler(BLOCK_SIZES, MAX_REQS, 64, 32, num_blocks=80, native=native, validate=False)
    dispatcher = CUDAGraphDispatcher(CUDAGraphMode.FULL, [1, 2, 4, 8, 16, 32], MAX_REQS, 32)
    padder = PaddedMetadata(MAX_REQS, "cpu")  # one per runner: its buffers persist across steps
    prev, next_block = [], 1
    for step, (requests, (want_P, want_Rp)) in enumerate(STEPS):
        so, blocks, next_block = _schedule(step, requests, prev, next_block)
        prev = list(blocks)
        sc.update_states(so)
        rows = sc.input_batch
        batch = dispatcher.dispatch(*batch_shape(rows.num_scheduled_tokens[:rows.num_reqs]))
        assert batch.use_graph and (batch.num_tokens_padded, batch.num_reqs_padded) == (want_P, want_Rp)
        inputs = sc.prepare_inputs(so, batch.num_tokens_padded)
        padded = padder.pad(inputs.common_attn_metadata, batch.num_reqs_padded)
        R, Q, P, Rp = inputs.num_reqs, inputs.num_actual_tokens, inputs.num_padded_tokens, batch.num_reqs_padded
        assert (R, Q, P) == (len(requests), sum(s for _, s in requests), want_P)
        order = [int(rid.split("r")[1]) for rid in inputs.req_ids]  # row -> index into requests
        _check_tokens(inputs, requests, order, blocks, Q, P, step)
        for g, cm in enumerate(padded):
            _check_padded_metadata(cm, requests, order, [blocks[inputs.req_ids[r]][g] for r in range(R)],
                                   R, Q, Rp, f"step {step} group {g}")


def _check_tokens(inputs, requests, order, blocks, Q, P, where):
    """Real tokens: positions and slots from the requests; padded tokens: 0, 0, PAD_SLOT_ID."""
    want_pos, want_slots = [], [[] for _ in BLOCK_SIZES]
    for r, i in enumerate(order):
        c, s = requests[i]
        for p in range(c, c + s):
            want_pos.append(p)
            for g, B in enumerate(BLOCK_SIZES):
                want_slots[g].append(blocks[inputs.req_ids[r]][g][p // B] * B + p % B)
    assert inputs.positions_cpu[:P].tolist() == want_pos + [0] * (P - Q), where
    assert inputs.positions[:P].tolist() == want_pos + [0] * (P - Q), where
    assert inputs.input_ids[Q:P].tolist() == [0] * (P - Q), where
    for g, cm in enumerate(inputs.common_attn_metadata):
        assert cm.slot_mapping.shape[0] == P, where
        assert cm.slot_mapping.tolist() == want_slots[g] + [PAD_SLOT_ID] * (P - Q), (where, g)


def _check_padded_metadata(cm, requests, order, block_ids, R, Q, Rp, where):
    qlens = [requests[i][1] for i in order]
    seq = [sum(requests[i]) for i in order]
    computed = [requests[i][0] for i in order]
    want_qsl = np.concatenate([[0], np.cumsum(qlens), [Q] * (Rp - R)]).tolist()
    assert cm.query_start_loc_cpu.tolist() == want_qsl == cm.query_start_loc.tolist(), where
    assert np.diff(want_qsl)[R:].tolist() == [0] * (Rp - R)  # padded requests: empty queries
    assert cm.seq_lens_cpu.tolist() == seq + [0] * (Rp - R) == cm.seq_lens.tolist(), where
    assert cm.num_computed_tokens_cpu.tolist() == computed + [0] * (Rp - R), where
    assert cm.is_prefilling is None or not cm.is_prefilling[R:].any(), where
    assert (cm.num_reqs, cm.num_actual_tokens) == (R, Q), where
    bt = cm.block_table_tensor
    assert bt.shape[0] == Rp and (bt[R:] == NULL_BLOCK_ID).all(), where
    for r, ids in enumerate(block_ids):
        assert bt[r, :len(ids)].tolist() == ids and (bt[r, len(ids):] == NULL_BLOCK_ID).all(), (where, r)
