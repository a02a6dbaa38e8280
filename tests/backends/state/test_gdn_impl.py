"""GDN impl and builder over state slots: chunked continuation == one shot, decode rows,
host chunk tables, fresh slots zeroed, padded rows untouched."""

from __future__ import annotations

import numpy as np
import torch

from attnplug.backends.state.gdn import fla_chunk_tables
from attnplug.core.metadata import CommonAttentionMetadata
from gdn_stepper import Stepper, _part, _seq  # noqa: E402 (tests/backends/conftest.py registers it)


def test_chunked_prefill_and_decodes_continue_exactly_like_one_shot():
    xa, xb = _seq(1, 15), _seq(2, 9)
    ref = Stepper()
    ya, _ = ref.step([(1, 0, xa)])
    yb, _ = ref.step([(2, 0, xb)])
    run = Stepper()
    # one-token first chunk, prefill continuing mid-chunk, decodes beside prefills
    plan_a = [(0, 5), (5, 6), (6, 13), (13, 14), (14, 15)]
    plan_b = [(0, 1), (1, 3), (3, 4), (4, 8), (8, 9)]
    got_a, got_b = [], []
    for pa, pb in zip(plan_a, plan_b):
        rows = sorted([(3, pa[0], _part(xa, *pa)), (5, pb[0], _part(xb, *pb))], key=lambda r: r[2][0].shape[0] != 1)
        out, md = run.step(rows, pad=2)
        assert (out[-2:] == -7.0).all(), "padded rows were written"
        n0 = rows[0][2][0].shape[0]
        first, second = out[:n0], out[n0:n0 + rows[1][2][0].shape[0]]
        (got_a, got_b)[rows[0][0] == 5].append(first)
        (got_a, got_b)[rows[1][0] == 5].append(second)
    torch.testing.assert_close(torch.cat(got_a), ya, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(got_b), yb, atol=1e-5, rtol=1e-5)
    for t_run, t_ref, name in zip(run.state, ref.state, ("conv_state", "recurrent_state")):
        torch.testing.assert_close(t_run[3], t_ref[1], msg=f"{name} of request a")
        torch.testing.assert_close(t_run[5], t_ref[2], msg=f"{name} of request b")
    untouched = [s for s in range(8) if s not in (3, 5)]
    assert all((t[untouched] == 0).all() for t in run.state), "a slot no row owns was written"


def test_a_reused_slot_starts_from_zeros():
    x = _seq(4, 6)
    fresh = Stepper()
    want, _ = fresh.step([(2, 0, x)])
    dirty = Stepper()
    for t in dirty.state:
        t[2] = float("nan")                 # a finished request's stale values
    got, md = dirty.step([(2, 0, x)])
    assert not md.has_initial_state[0]
    torch.testing.assert_close(got, want)


def test_builder_chunks_start_at_each_sequence_and_tables_are_host_arrays():
    s = Stepper()
    cm = CommonAttentionMetadata.from_lengths([5, 6, 0], [1, 7, 2], [[1], [2], [3]], block_size=1024)
    md = s.builder.build(0, cm)
    assert (md.num_decodes, md.num_prefills, md.num_prefill_tokens) == (1, 2, 9)
    assert md.has_initial_state.tolist() == [True, True, False]
    # sequence 1 starts at position 6 but its chunks start at its first token: 4 + 3
    assert md.cu_chunk_seqlen.tolist() == [0, 4, 7, 9]
    assert isinstance(md.chunk_indices, np.ndarray) and isinstance(md.chunk_offsets, np.ndarray)
    assert md.chunk_indices.tolist() == [[0, 0], [0, 1], [1, 0]] and md.chunk_offsets.tolist() == [0, 2, 3]
    ci, co = fla_chunk_tables(np.array([0, 0, 0, 2]), 3)
    assert ci.tolist() == [[0, 0], [0, 1], [0, 2], [2, 0]] and co.tolist() == [0, 3, 3, 4]
