"""The gated delta rule in torch: chunked == token by token, and == transformers' own torch path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.backends.mamba2.layout import compute_prefill_layout
from attnplug.backends.state.gdn import ops

H, DK, DV = 2, 4, 3


def _inputs(seed, T):
    g = torch.Generator().manual_seed(seed)
    q = ops.l2norm(torch.randn(T, H, DK, generator=g)) * DK ** -0.5
    k = ops.l2norm(torch.randn(T, H, DK, generator=g))
    v = torch.randn(T, H, DV, generator=g)
    gate = -torch.rand(T, H, generator=g) * 2.0        # log decay <= 0
    beta = torch.rand(T, H, generator=g)
    return q, k, v, gate, beta


def _chunked(lengths, starts, chunk_size, q, k, v, g, beta, s0):
    lay = compute_prefill_layout(np.array(lengths), np.array(starts), chunk_size, 0)
    idx = [torch.from_numpy(a) for a in (lay.chunk_token_index, lay.token_chunk_index, lay.chunk_grid_index)]
    return ops.chunk_gated_delta_rule(q, k, v, g, beta, s0, *idx, chunk_size=chunk_size,
                                      max_chunks_per_seq=lay.max_chunks_per_seq)


@pytest.mark.parametrize("starts", [[0, 0, 0], [3, 0, 5]], ids=["from-seq-start", "absolute-offsets"])
def test_chunked_packed_sequences_equal_the_token_by_token_recurrence(starts):
    lengths = [9, 1, 6]       # several chunks, a one-token sequence, a partial last chunk
    q, k, v, g, beta = _inputs(0, sum(lengths))
    s0 = torch.randn(3, H, DK, DV, generator=torch.Generator().manual_seed(1))
    o, final = _chunked(lengths, starts, 4, q, k, v, g, beta, s0)
    bounds = np.cumsum([0] + lengths)
    for i in range(3):
        sl = slice(bounds[i], bounds[i + 1])
        o_ref, f_ref = ops.recurrent_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], s0[i])
        torch.testing.assert_close(o[sl], o_ref, atol=1e-5, rtol=1e-5, msg=f"sequence {i} output")
        torch.testing.assert_close(final[i], f_ref, atol=1e-5, rtol=1e-5, msg=f"sequence {i} final state")


def test_matches_transformers_torch_gated_delta_rule():
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    T = 11
    g0 = torch.Generator().manual_seed(3)
    q, k = torch.randn(T, H, DK, generator=g0), torch.randn(T, H, DK, generator=g0)
    v = torch.randn(T, H, DV, generator=g0)
    gate, beta = -torch.rand(T, H, generator=g0), torch.rand(T, H, generator=g0)
    s0 = torch.randn(1, H, DK, DV, generator=g0)
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], gate[None], beta[None], chunk_size=4,
                                                   initial_state=s0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    qn, kn = ops.l2norm(q) * DK ** -0.5, ops.l2norm(k)
    o, final = _chunked([T], [0], 4, qn, kn, v, gate, beta, s0)
    torch.testing.assert_close(o, ref_o[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_s, atol=1e-5, rtol=1e-5)
    o1, s1 = ops.gated_delta_step(s0.clone(), qn[:1], kn[:1], v[:1], gate[:1], beta[:1])
    ref_o1, ref_s1 = hf.torch_recurrent_gated_delta_rule(q[None, :1], k[None, :1], v[None, :1], gate[None, :1],
                                                         beta[None, :1], initial_state=s0, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o1, ref_o1[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s1, ref_s1, atol=1e-5, rtol=1e-5)
