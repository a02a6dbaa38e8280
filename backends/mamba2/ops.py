"""Mamba2 math in plain torch: causal conv1d with state, chunked SSD scan, recurrent update.

Pure functions over already-gathered tensors (the impl gathers states from slots and
writes them back). Everything is vectorized over tokens, chunks and sequences; the only
Python loop is over the ``conv_kernel_size`` taps' window (none here: one gather).

Notation (Mamba2 paper, "State Space Duality"): per head ``h``, with ``dt_t > 0`` the
time step, ``a_t = dt_t * A_h <= 0`` the log decay, ``x_t`` the input, ``B_t``, ``C_t``
the group's input/output projections of the state (``state_size`` wide)::

    S_t = exp(a_t) * S_{t-1} + (dt_t * x_t) outer B_t        # [head_size, state_size]
    y_t = S_t @ C_t                                            # [head_size]

The chunked form (SSD) splits a sequence into chunks; inside a chunk the outputs are a
masked "attention" ``y_l = sum_{s<=l} (C_l . B_s) exp(a_{s+1} + .. + a_l) dt_s x_s`` plus
the contribution of the state entering the chunk, ``exp(a_0 + .. + a_l) C_l . S_start``;
chunk states are carried between chunks by a (small) recurrence over chunk totals.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segsum(a: torch.Tensor) -> torch.Tensor:
    """Stable segment sums: ``out[..., l, s] = a[..., s+1] + ... + a[..., l]`` for ``s <= l``
    (0 on the diagonal), ``-inf`` above it.

    Args:
        a: ``[..., L]``, float.

    Returns:
        ``[..., L, L]``, same dtype; ``exp(out)`` is the decay from position ``s`` to ``l``.
        Computed as masked cumulative sums, not as differences of prefix sums (which lose
        precision when the prefix sums are large).
    """
    L = a.shape[-1]
    strict = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)
    x = a.unsqueeze(-1).expand(*a.shape, L).masked_fill(~strict, 0.0)
    out = x.cumsum(dim=-2)
    return out.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=a.device).tril(0), float("-inf"))


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          initial_state: torch.Tensor, conv_token_pos: torch.Tensor,
                          conv_state_pos: torch.Tensor, conv_final_pos: torch.Tensor,
                          conv_window_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d over packed sequences that continue from a conv state.

    Args:
        x: ``[num_prefill_tokens, conv_dim]``, float.
        weight: ``[conv_dim, conv_kernel_size]``; output ``t`` is
            ``sum_k weight[:, k] * input[t - (conv_kernel_size - 1) + k]``.
        bias: ``[conv_dim]`` or ``None``.
        initial_state: ``[num_prefills, conv_dim, conv_kernel_size - 1]``, the inputs
            before each sequence (oldest first; zeros for a fresh sequence).
        conv_token_pos, conv_state_pos, conv_final_pos, conv_window_pos: the layout's
            extended-stream indices (``backends.mamba2.layout``), ``torch.int64``.

    Returns:
        ``(out, final_state)``: ``out`` ``[num_prefill_tokens, conv_dim]`` (no activation)
        and ``final_state`` ``[num_prefills, conv_dim, conv_kernel_size - 1]``, the last
        ``conv_kernel_size - 1`` inputs of each sequence (state columns included when the
        sequence is shorter than that).
    """
    T, C = x.shape
    P, _, dm1 = initial_state.shape
    ext = x.new_empty((T + P * dm1, C))
    ext.index_copy_(0, conv_token_pos, x)
    if dm1:
        ext.index_copy_(0, conv_state_pos, initial_state.transpose(1, 2).reshape(P * dm1, C))
    windows = ext.index_select(0, conv_window_pos).view(T, dm1 + 1, C)
    out = (windows * weight.t()).sum(dim=1)   # depthwise: no per-channel matmuls
    if bias is not None:
        out = out + bias
    final = ext.index_select(0, conv_final_pos).view(P, dm1, C).transpose(1, 2)
    return out, final


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One conv1d step per sequence.

    Args:
        x: ``[num_decodes, conv_dim]``, this step's input.
        weight: ``[conv_dim, conv_kernel_size]``.
        bias: ``[conv_dim]`` or ``None``.
        state: ``[num_decodes, conv_dim, conv_kernel_size - 1]``, previous inputs.

    Returns:
        ``(out [num_decodes, conv_dim], new_state)`` (no activation); ``new_state`` drops
        the oldest column and appends ``x``.
    """
    window = torch.cat([state, x.unsqueeze(-1)], dim=-1)
    out = (window * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return out, window[..., 1:]


def _chunked(t: torch.Tensor, chunk_token_index: torch.Tensor, num_chunks: int, chunk_size: int) -> torch.Tensor:
    """``[T, D1, *rest]`` -> ``[num_chunks, D1, chunk_size, *rest]``, contiguous (heads or
    groups before the chunk rows); padding rows read an appended zero row."""
    padded = torch.cat([t, t.new_zeros((1, *t.shape[1:]))])
    c = padded.index_select(0, chunk_token_index).view(num_chunks, chunk_size, *t.shape[1:])
    return c.transpose(1, 2).contiguous()


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   initial_state: torch.Tensor, chunk_token_index: torch.Tensor,
                   token_chunk_index: torch.Tensor, chunk_grid_index: torch.Tensor, *,
                   chunk_size: int, max_chunks_per_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan of packed sequences with initial states (no ``D`` skip).

    Args:
        x: ``[num_prefill_tokens, num_heads, head_size]``, float32.
        dt: ``[num_prefill_tokens, num_heads]``, float32, the final time steps (after
            bias, softplus and clamping).
        A: ``[num_heads]``, float32, negative.
        B, C: ``[num_prefill_tokens, n_groups, state_size]``, float32; head ``h`` reads
            group ``h // (num_heads // n_groups)``.
        initial_state: ``[num_prefills, num_heads, head_size, state_size]``, float32
            (zeros for a fresh sequence).
        chunk_token_index, token_chunk_index, chunk_grid_index: the layout's chunk indices
            (``backends.mamba2.layout``), ``torch.int64``.
        chunk_size: rows per chunk in ``chunk_token_index``.
        max_chunks_per_seq: width of the inter-chunk grid.

    Returns:
        ``(y, final_state)``: ``y`` ``[num_prefill_tokens, num_heads, head_size]`` and
        ``final_state`` ``[num_prefills, num_heads, head_size, state_size]`` (the state
        after each sequence's last token; the initial state for an empty sequence).

    Inside a chunk the decay ``exp(a_{s+1} + .. + a_l)`` is ``exp(cum_l - cum_s)`` of the
    chunk's prefix sums (as the mamba_ssm kernels compute it). Memory: ``[num_chunks,
    num_heads, chunk_size, chunk_size]`` float32 for the in-chunk scores.
    """
    T, H, Pd = x.shape
    G, N = B.shape[1], B.shape[2]
    K = chunk_grid_index.shape[0]
    S, M = initial_state.shape[0], max_chunks_per_seq
    cs = chunk_size
    rep = H // G
    xdt = _chunked(x * dt.unsqueeze(-1), chunk_token_index, K, cs)             # [K, H, cs, Pd]
    a_cum = _chunked(dt * A, chunk_token_index, K, cs).cumsum(dim=-1)          # [K, H, cs]
    Bg = _chunked(B, chunk_token_index, K, cs).unsqueeze(2)                    # [K, G, 1, cs, N]
    Cg = _chunked(C, chunk_token_index, K, cs).unsqueeze(2)
    causal = torch.ones(cs, cs, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp((a_cum.unsqueeze(-1) - a_cum.unsqueeze(-2)).masked_fill_(~causal, float("-inf")))

    # 1. inside each chunk: masked "attention" (C_l . B_s) * decay(s -> l), per group, per head
    scores = (Cg @ Bg.transpose(-1, -2)) * decay.view(K, G, rep, cs, cs)      # [K, G, rep, l, s]
    y = scores @ xdt.view(K, G, rep, cs, Pd)                                   # [K, G, rep, cs, Pd]
    # 2. each chunk's state at its end, starting from zero: sum_s decay(s -> end) x_s dt_s B_s^T
    to_end = decay[..., -1, :].view(K, G, rep, cs, 1)
    chunk_states = (xdt.view(K, G, rep, cs, Pd) * to_end).transpose(-1, -2) @ Bg   # [K, G, rep, Pd, N]
    # 3. carry states across the chunks of each sequence: grid [S, M] of chunk totals
    totals = x.new_zeros((S * M, H)).index_copy_(0, chunk_grid_index, a_cum[..., -1]).view(S, M, H)
    grid = x.new_zeros((S * M, H, Pd * N)).index_copy_(0, chunk_grid_index, chunk_states.view(K, H, Pd * N))
    states = torch.cat([initial_state.reshape(S, 1, H, Pd * N), grid.view(S, M, H, Pd * N)], dim=1)
    carry = torch.exp(segsum(F.pad(totals.transpose(1, 2), (1, 0))))          # [S, H, M + 1, M + 1]
    entering = carry @ states.transpose(1, 2)                                  # [S, H, M + 1, Pd * N]
    final_state = entering[:, :, M].reshape(S, H, Pd, N)
    start = entering[:, :, :M].transpose(1, 2).reshape(S * M, H, Pd, N).index_select(0, chunk_grid_index)
    # 4. the entering state's contribution to every output of the chunk: exp(cum_l) C_l . S
    y_off = Cg @ start.view(K, G, rep, Pd, N).transpose(-1, -2)                # [K, G, rep, cs, Pd]
    y = y + y_off * torch.exp(a_cum).view(K, G, rep, cs, 1)
    y = y.view(K, H, cs, Pd).transpose(1, 2).reshape(K * cs, H, Pd)
    return y.index_select(0, token_chunk_index), final_state


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step per sequence (no ``D`` skip), updating ``state`` IN PLACE.

    Args:
        state: ``[num_decodes, num_heads, head_size, state_size]``, float32, contiguous
            (a gathered copy: it is overwritten with the new state).
        x: ``[num_decodes, num_heads, head_size]``, float32.
        dt: ``[num_decodes, num_heads]``, float32, final time steps.
        A: ``[num_heads]``, float32, negative.
        B, C: ``[num_decodes, n_groups, state_size]``, float32.

    Returns:
        ``(y [num_decodes, num_heads, head_size], state)``.
    """
    D, H, Pd = x.shape
    G, N = B.shape[1], B.shape[2]
    rep = H // G
    st = state.view(D, G, rep, Pd, N)
    st.mul_(torch.exp(dt * A).view(D, G, rep, 1, 1))
    st.add_((dt.unsqueeze(-1) * x).view(D, G, rep, Pd, 1) * B.view(D, G, 1, 1, N))
    y = st @ C.view(D, G, 1, N, 1)                                             # [D, G, rep, Pd, 1]
    return y.view(D, H, Pd), state
