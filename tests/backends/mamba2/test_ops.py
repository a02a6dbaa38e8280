"""Mamba2 torch math: segsum, conv1d with state, chunked SSD scan vs a token-by-token recurrence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnplug.backends.mamba2 import ops
from attnplug.backends.mamba2.layout import compute_prefill_layout


def _recurrence(x, dt, A, B, C, state):
    """Explicit per-token, per-head loop: S = exp(dt*A) S + dt x B^T; y = S C."""
    L, H, _ = x.shape
    rep = H // B.shape[1]
    state = state.clone()
    ys = torch.empty_like(x)
    for t in range(L):
        for h in range(H):
            g = h // rep
            state[h] = torch.exp(dt[t, h] * A[h]) * state[h] + dt[t, h] * torch.outer(x[t, h], B[t, g])
            ys[t, h] = state[h] @ C[t, g]
    return ys, state


def _inputs(gen, T, H=4, P=3, G=2, N=5):
    x = torch.randn(T, H, P, generator=gen)
    dt = F.softplus(torch.randn(T, H, generator=gen))
    A = -torch.rand(H, generator=gen) * 2 - 0.1
    B = torch.randn(T, G, N, generator=gen)
    C = torch.randn(T, G, N, generator=gen)
    return x, dt, A, B, C


def _t(a):
    return torch.as_tensor(a, dtype=torch.int64)


def test_segsum_matches_naive_sums():
    a = torch.randn(2, 6, dtype=torch.float64)
    out = ops.segsum(a)
    for l in range(6):
        for s in range(6):
            want = a[:, s + 1:l + 1].sum(-1) if s <= l else torch.full((2,), float("-inf"), dtype=torch.float64)
            torch.testing.assert_close(out[:, l, s], want)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 16])
def test_chunk_scan_matches_recurrence_packed_with_initial_states(chunk_size):
    gen = torch.Generator().manual_seed(chunk_size)
    lens = np.array([7, 1, 11, 4])
    computed = np.array([5, 0, 2, 8])  # chunk boundaries start mid-chunk for some sequences
    x, dt, A, B, C = _inputs(gen, int(lens.sum()))
    init = torch.randn(len(lens), 4, 3, 5, generator=gen)
    init[1] = 0
    lay = compute_prefill_layout(lens, computed, chunk_size, 3)
    y, final = ops.ssd_chunk_scan(x, dt, A, B, C, init, _t(lay.chunk_token_index), _t(lay.token_chunk_index),
                                  _t(lay.chunk_grid_index), chunk_size=chunk_size,
                                  max_chunks_per_seq=lay.max_chunks_per_seq)
    for i in range(len(lens)):
        s, e = lay.query_start_loc[i], lay.query_start_loc[i + 1]
        y_ref, f_ref = _recurrence(x[s:e], dt[s:e], A, B[s:e], C[s:e], init[i])
        torch.testing.assert_close(y[s:e], y_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final[i], f_ref, rtol=1e-4, atol=1e-4)


def test_selective_state_update_is_one_recurrence_step():
    gen = torch.Generator().manual_seed(3)
    x, dt, A, B, C = _inputs(gen, 1)
    state = torch.randn(4, 3, 5, generator=gen)
    work = state[None].clone()
    y, new = ops.selective_state_update(work, x, dt, A, B, C)
    y_ref, new_ref = _recurrence(x, dt, A, B, C, state)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(new[0], new_ref)
    assert new is work, "the update is in place on the gathered copy"


def test_conv_prefill_matches_conv1d_over_state_and_inputs():
    gen = torch.Generator().manual_seed(4)
    lens, K, Cd = np.array([5, 1, 2]), 4, 6
    x = torch.randn(int(lens.sum()), Cd, generator=gen)
    w, b = torch.randn(Cd, K, generator=gen), torch.randn(Cd, generator=gen)
    init = torch.randn(3, Cd, K - 1, generator=gen)
    lay = compute_prefill_layout(lens, np.zeros(3, np.int64), 4, K - 1)
    out, final = ops.causal_conv1d_prefill(x, w, b, init, _t(lay.conv_token_pos), _t(lay.conv_state_pos),
                                           _t(lay.conv_final_pos), _t(lay.conv_window_pos))
    for i in range(3):
        s, e = lay.query_start_loc[i], lay.query_start_loc[i + 1]
        seq = torch.cat([init[i], x[s:e].T], dim=1)  # [C, K-1+L]
        ref = F.conv1d(seq[None], w[:, None, :], b, groups=Cd)[0].T
        torch.testing.assert_close(out[s:e], ref)
        torch.testing.assert_close(final[i], seq[:, -(K - 1):])


def test_conv_decode_shifts_state():
    state = torch.arange(6.0).view(1, 2, 3)
    x = torch.tensor([[10.0, 20.0]])
    w = torch.ones(2, 4)
    out, new = ops.causal_conv1d_decode(x, w, None, state)
    assert out.tolist() == [[0 + 1 + 2 + 10, 3 + 4 + 5 + 20]]
    assert new.tolist() == [[[1, 2, 10], [4, 5, 20]]]
