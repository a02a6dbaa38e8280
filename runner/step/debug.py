"""Debug views of the step compiler's state: the validator's batch view, snapshots, diffs.

Not for the hot path: :func:`snapshot` copies the whole token table. The tests use
``snapshot`` / ``snapshot_diff`` to prove that a rejected output changed nothing;
``attnplug.core.validate`` reads :func:`batch_view`.
"""

from __future__ import annotations

import numpy as np

from attnplug.core.validation import BatchView, RowState
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.request_state import CachedRequestState


def batch_view(batch: InputBatch, requests: dict[str, CachedRequestState]) -> BatchView:
    """The columnar view for ``attnplug.core.validate`` (rows and object view). Debug use."""
    b = batch
    R = b.num_reqs
    states = {}
    for rid in b._req_ids[:R]:
        st = requests.get(rid) if rid is not None else None
        if st is not None:
            tokens = list(st.prompt_token_ids) + list(st.output_token_ids)
            sp = st.sampling_params
            states[rid] = RowState(rid, tokens, st.num_computed_tokens, st.block_ids,
                                   sampling=(sp.temperature, sp.top_k, sp.top_p), generator=st.generator)
    return BatchView(
        req_ids=list(b._req_ids[:R]), req_id_to_index=dict(b.req_id_to_index),
        token_ids=b.token_ids_cpu, num_tokens=b.num_tokens,
        num_computed_tokens=b.num_computed_tokens_cpu,
        block_ids=[bt.block_table_np for bt in b.block_table],
        num_blocks=[bt.num_blocks_per_row for bt in b.block_table], states=states,
        sampling=(b.temperature, b.top_k, b.top_p), generators=dict(b.generators))


def snapshot(batch: InputBatch, requests: dict[str, CachedRequestState]) -> dict:
    """A deep copy of every piece of state (both views), for before/after comparisons
    in tests. Not for the hot path: it copies the whole token table."""
    b = batch
    snap = {
        "token_ids": b.token_ids_cpu.copy(),
        "columns": [c.copy() for c in b.row_columns],
        "num_spec_tokens": b.num_spec_tokens.copy(),
        "num_prev_sampled": b.num_prev_sampled,
        "req_ids": list(b._req_ids),
        "states_by_row": [None if s is None else id(s) for s in b._states],
        "req_id_to_index": dict(b.req_id_to_index),
        "holes": sorted(b._holes),
        "num_rows": b._num_rows,
        "generators": {r: id(g) for r, g in b.generators.items()},
        "block_tables": [(bt.block_table_np.copy(), bt.kernel_block_table.np.copy(),
                          bt.num_blocks_per_row.copy()) for bt in b.block_table],
        "requests": {rid: (id(st), st.row, st.all_token_ids, st.num_computed_tokens, st.block_ids,
                           st.sampling_params, id(st.generator))
                     for rid, st in requests.items()},
    }
    return snap


def snapshot_diff(a, b, path: str = "state") -> list[str]:
    """Where two :func:`snapshot` results differ (paths like
    ``state['columns'][2]``); empty when they are identical (arrays: same dtype and values)."""
    if isinstance(a, np.ndarray):
        same = isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [path]
        return [d for k in a for d in snapshot_diff(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [path]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in snapshot_diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]
