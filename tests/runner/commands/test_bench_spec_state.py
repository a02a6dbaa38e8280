"""``attnplug bench step --state-spec-steps``: the step with drafts on a Mamba2 and a GDN state
group, beside decodes and the same tokens as prefill chunks (runner/commands/bench/spec_state.py)."""

from __future__ import annotations

import numpy as np
import torch

from attnplug.runner.commands.bench.spec_state import _common, _setup, render_spec_state, run_spec_state


def test_the_hybrid_table_has_a_mamba2_and_a_gdn_row_per_workload():
    rows = run_spec_state(4, 3, 1, 1)
    assert [(r["kind"], r["workload"].split()[1]) for r in rows] == [
        (k, m) for k in ("mamba2", "gdn") for m in ("decode", "verify", "prefill")]
    assert all(r["ratio_to_decode"] == 1.0 for r in rows if "decode" in r["workload"])
    assert all(r["times"]["total"] > 0 for r in rows)
    text = render_spec_state(rows, markdown=True)
    assert "gdn verify N=4, k=3" in text and "gdn prefill 1+3 tokens N=4" in text


def test_the_timed_gdn_verify_step_writes_every_draft_position_into_its_column():
    """What the table times is the real path: the verify forward leaves a state after each of
    the 1 + k positions in the row's block-table column (the scratch slots change)."""
    builder, impl, state, layer, widths, out_shape, table = _setup(2, 3, "gdn")
    before = [t.clone() for t in state]
    md = builder.build(0, _common(2, 4, table, 3))
    ins = [torch.randn(8, w) for w in widths]
    impl.forward(layer, *ins, state, md, torch.empty(8, *out_shape))
    for t, b in zip(state, before):
        changed = (t != b).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == sorted(table.reshape(-1).tolist()), changed
    assert np.array_equal(md.verify_write_slots.numpy(), table.reshape(-1))
