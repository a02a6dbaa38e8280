"""The gated delta rule in plain torch: recurrent step (decode) and chunked form (prefill).

Pure functions over already-gathered tensors (the impl gathers states from slots and
writes them back). Inputs are float32, ``q``/``k`` already l2-normalised and expanded to
the value heads, ``q`` already scaled by ``head_k_dim ** -0.5``.

Recurrence, per head (``S`` ``[head_k_dim, head_v_dim]``; Yang et al., "Gated Delta
Networks"; transformers' ``torch_recurrent_gated_delta_rule`` computes the same)::

    S_t = exp(g_t) S_{t-1};   S_t += k_t outer beta_t (v_t - S_t^T k_t);   o_t = S_t^T q_t

Chunked form (the WY / UT-transform representation of DeltaNet, Yang et al. 2024; the
facts of transformers' ``torch_chunk_gated_delta_rule``). Inside a chunk, with ``G_i`` the
cumulative log decay from the chunk's start through row ``i`` and ``S`` the state
entering the chunk::

    A_ij = beta_i (k_i . k_j) exp(G_i - G_j)         for j < i (strictly lower, else 0)
    (I + A) U = beta * V,   (I + A) W = beta * K * exp(G)     # two unit-lower solves
    V' = U - W S                                     # what the writes add beyond S
    O_i = exp(G_i) q_i S + sum_{j <= i} (q_i . k_j) exp(G_i - G_j) V'_j
    S_out = exp(G_last) S + sum_j exp(G_last - G_j) k_j outer V'_j

Everything inside a chunk is batched over all chunks of the step; the only loop runs over
the chunk position ``j < max_chunks_per_seq``, carrying every sequence's state at once.
"""

from __future__ import annotations

import torch

from attnplug.backends.mamba2.ops import _chunked


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)`` (flash-linear-attention's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step per sequence, updating ``state`` IN PLACE.

    Args:
        state: ``[n, H, dk, dv]``, float32, a gathered copy (overwritten).
        q, k: ``[n, H, dk]``; v: ``[n, H, dv]``; g, beta: ``[n, H]`` (float32).

    Returns:
        ``(o [n, H, dv], state)``.
    """
    state.mul_(g.exp()[..., None, None])
    kv = (k.unsqueeze(-2) @ state).squeeze(-2)                      # S^T k: [n, H, dv]
    delta = (v - kv) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over one sequence (the reference the chunked form is tested against).

    Args:
        q, k: ``[T, H, dk]``; v: ``[T, H, dv]``; g, beta: ``[T, H]``; initial_state
            ``[H, dk, dv]`` (all float32).

    Returns:
        ``(o [T, H, dv], final_state [H, dk, dv])``.
    """
    state = initial_state.clone().unsqueeze(0)
    out = []
    for t in range(q.shape[0]):
        o, state = gated_delta_step(state, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
        out.append(o)
    o = torch.cat(out) if out else v.new_zeros(v.shape)
    return o, state[0]


def _intra_chunk(qc, kc, vc, gc, bc):
    """Per chunk: ``U``, ``W``, the masked in-chunk scores, the decayed q and k and the chunk
    decay (see the module docstring); inputs ``[K, H, C, d]`` / ``[K, H, C]``."""
    C = qc.shape[2]
    G = gc.cumsum(dim=-1)                                           # [K, H, C]
    lower = torch.ones(C, C, dtype=torch.bool, device=qc.device).tril()
    decay = torch.exp((G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~lower, float("-inf")))
    A = ((bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2))) * decay).tril(-1)
    L = A + torch.eye(C, dtype=A.dtype, device=A.device)
    U = torch.linalg.solve_triangular(L, vc * bc.unsqueeze(-1), upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(L, kc * (bc * G.exp()).unsqueeze(-1), upper=False, unitriangular=True)
    scores = (qc @ kc.transpose(-1, -2)) * decay
    q_dec = qc * G.exp().unsqueeze(-1)
    k_dec = kc * torch.exp(G[..., -1:] - G).unsqueeze(-1)
    return U, W, scores, q_dec, k_dec, G[..., -1].exp()


def _with_zero_chunk(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [torch.cat([t, t.new_zeros((1, *t.shape[1:]))]) for t in ts]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor, chunk_token_index: torch.Tensor,
                           token_chunk_index: torch.Tensor, chunk_grid_index: torch.Tensor, *,
                           chunk_size: int, max_chunks_per_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over packed sequences with initial states.

    Args:
        q, k: ``[num_prefill_tokens, H, dk]``; v: ``[num_prefill_tokens, H, dv]``; g, beta:
            ``[num_prefill_tokens, H]`` (float32).
        initial_state: ``[num_prefills, H, dk, dv]`` float32 (zeros for a fresh sequence).
        chunk_token_index, token_chunk_index, chunk_grid_index: the step's chunk layout
            (``backends.mamba2.layout.PrefillLayout``), ``torch.int64``, device.
        chunk_size: rows per chunk; max_chunks_per_seq: width of the chunk grid.

    Returns:
        ``(o [num_prefill_tokens, H, dv], final_state [num_prefills, H, dk, dv])``.

    Padding rows of a chunk read zeros (``k = 0``, ``beta = 0``, ``g = 0``): they leave the
    state unchanged. Memory: ``[num_chunks, H, chunk_size, chunk_size]`` float32 twice.
    """
    K, C = chunk_grid_index.shape[0], chunk_size
    P, M = initial_state.shape[0], max_chunks_per_seq
    chunked = [_chunked(t, chunk_token_index, K, C) for t in (q, k, v, g, beta)]
    U, W, scores, q_dec, k_dec, chunk_decay = _intra_chunk(*chunked)
    U, W, scores, q_dec, k_dec = _with_zero_chunk(U, W, scores, q_dec, k_dec)
    chunk_decay = torch.cat([chunk_decay, chunk_decay.new_ones((1, chunk_decay.shape[1]))])
    # grid [P, M] -> chunk id; K (the appended zero chunk: no write, decay 1) where a sequence has fewer chunks
    grid = torch.full((P * M,), K, dtype=torch.int64, device=q.device)
    grid = grid.index_copy_(0, chunk_grid_index, torch.arange(K, device=q.device)).view(P, M)
    state = initial_state.clone()
    out = U.new_zeros(U.shape)
    for j in range(M):
        idx = grid[:, j]
        v_new = U[idx] - W[idx] @ state
        out[idx] = q_dec[idx] @ state + scores[idx] @ v_new
        state = state * chunk_decay[idx][..., None, None] + k_dec[idx].transpose(-1, -2) @ v_new
    o = out[:K].transpose(1, 2).reshape(K * C, out.shape[1], out.shape[-1])
    return o.index_select(0, token_chunk_index), state
