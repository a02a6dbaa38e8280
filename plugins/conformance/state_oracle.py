"""A state case's inputs and layer parameters, and the Mamba2 reference recurrence.

Every token's inputs (``xBC`` before the conv, raw ``dt``) depend only on (seed, request,
position), so runs that batch, order or preempt requests differently see the same
inputs. The reference runs each request token by token in float64 from a zero state,
with the definitions of :class:`~attnplug.core.mamba.MambaImpl` (``core/mamba.py``)::

    conv_t  = silu(bias + sum_k weight[:, k] * xBC[t - (K - 1) + k])     # zeros before 0
    x, B, C = split(conv_t)                   # [H, P], [G, N], [G, N]; head h reads group h // (H / G)
    dt_t    = softplus(dt_raw_t + dt_bias)    # [H]
    S_t     = exp(dt_t * A) * S_{t-1} + dt_t * x_t outer B_t,  A = -exp(A_log)
    y_t     = S_t @ C_t + D * x_t             # not gated

and keeps, after every position, the conv state (the last ``K - 1`` raw inputs, oldest
first) and the SSM state ``S_t``.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from attnplug.plugins.conformance.requirements import torch_dtype
from attnplug.plugins.conformance.state_cases import StateCase


def request_plan(case: StateCase) -> tuple[list[int], list[int], list[int]]:
    """``(reach, prompt_lens, starts)`` per request: positions the schedule reaches (drafts
    included), the prompt the harness admits (the whole reach, or up to the first verifying
    step's last real token: a verifying row has exactly one real token left), and the
    tokens a prefix hit starts from (0 without one). A verifying step advances the request
    by ``1 + accepted``."""
    n_req = case.num_requests
    starts = [0] * n_req
    for r, _, h in case.prefix_hits:
        starts[r] = h
    done, reach, prompt = list(starts), list(starts), [0] * n_req
    verify = {(s, r): a for s, r, a in case.verify}
    preempt = set(case.preempt)
    for s, step in enumerate(case.steps):
        for r in range(n_req):
            if (s, r) in preempt:
                done[r] = 0
        for r, n in step:
            reach[r] = max(reach[r], done[r] + n)
            a = verify.get((s, r))
            if a is not None and not prompt[r]:
                prompt[r] = done[r] + 1
            done[r] += n if a is None else 1 + a
    return reach, [p or n for p, n in zip(prompt, reach)], starts


def request_lengths(case: StateCase) -> list[int]:
    """Tokens each request reaches (the furthest position + 1 over the schedule, drafts included)."""
    return request_plan(case)[0]


class StateInputs:
    """Per request ``i`` with ``L_i`` tokens: ``xbc[i]`` ``[L_i, conv_dim]`` and ``dt[i]``
    ``[L_i, num_heads]`` in the case dtype; ``layer``: the parameters an impl reads (HF
    ``BambaMixer`` names: ``conv1d.weight`` ``[conv_dim, 1, K]``, ``conv1d.bias``,
    ``A_log``, ``D``, ``dt_bias``), in the case dtype, on ``device``. ``xbc_rejected`` /
    ``dt_rejected``: other inputs of the same shapes, fed at rejected draft positions. A
    prefix hit's first ``tokens`` inputs are its source's."""

    def __init__(self, case: StateCase, device: torch.device | str = "cpu"):
        self.case = case
        dtype = torch_dtype(case.dtype)
        H, P, N, G, K = case.num_heads, case.head_size, case.state_size, case.n_groups, case.conv_kernel_size
        self.conv_dim = H * P + 2 * G * N
        g = torch.Generator().manual_seed(case.seed * 104729 + 17)
        weight = torch.randn(self.conv_dim, 1, K, generator=g) * 0.5
        params = dict(bias=torch.randn(self.conv_dim, generator=g) * 0.1,
                      A_log=torch.log(torch.rand(H, generator=g) * 3 + 1), D=torch.rand(H, generator=g),
                      dt_bias=torch.randn(H, generator=g) * 0.5)
        self.layer = types.SimpleNamespace(
            conv1d=types.SimpleNamespace(weight=weight.to(dtype).to(device), bias=params["bias"].to(dtype).to(device)),
            **{k: params[k].to(dtype).to(device) for k in ("A_log", "D", "dt_bias")})
        self.xbc, self.dt, self.xbc_rejected, self.dt_rejected = [], [], [], []
        for i, n in enumerate(request_lengths(case)):
            gi = torch.Generator().manual_seed(case.seed * 7919 + i)
            self.xbc.append(torch.randn(n, self.conv_dim, generator=gi).to(dtype))
            self.dt.append((torch.randn(n, H, generator=gi) * 0.5).to(dtype))
            self.xbc_rejected.append(torch.randn(n, self.conv_dim, generator=gi).to(dtype))
            self.dt_rejected.append((torch.randn(n, H, generator=gi) * 0.5).to(dtype))
        for r, src, h in case.prefix_hits:   # a hit shares the source's first h inputs
            self.xbc[r][:h], self.dt[r][:h] = self.xbc[src][:h], self.dt[src][:h]


class Reference:
    """The float64 recurrence of every request (see the module docstring).

    Attributes:
        y: per request, ``[L_i, num_heads * head_size]`` float64 outputs.
        conv: per request, ``[L_i + 1, conv_dim, K - 1]``: the conv state after ``t``
            tokens (row 0: zeros).
        ssm: per request, ``[L_i + 1, num_heads, head_size, state_size]``: the SSM state
            after ``t`` tokens.
    """

    def __init__(self, inputs: StateInputs):
        case, lay = inputs.case, inputs.layer
        H, P, N, G, K = case.num_heads, case.head_size, case.state_size, case.n_groups, case.conv_kernel_size
        w = lay.conv1d.weight.cpu().double().reshape(inputs.conv_dim, K)
        b = lay.conv1d.bias.cpu().double()
        A = -torch.exp(lay.A_log.cpu().double())
        D, dt_bias = lay.D.cpu().double(), lay.dt_bias.cpu().double()
        self.y, self.conv, self.ssm = [], [], []
        for xbc, dt_raw in zip(inputs.xbc, inputs.dt):
            L = xbc.shape[0]
            ext = torch.cat([torch.zeros(K - 1, inputs.conv_dim, dtype=torch.float64), xbc.double()])
            windows = ext.unfold(0, K, 1)                          # [L, conv_dim, K], oldest first
            conv_out = F.silu((windows * w).sum(-1) + b)
            x = conv_out[:, :H * P].reshape(L, H, P)
            Bm = conv_out[:, H * P:H * P + G * N].reshape(L, G, N).repeat_interleave(H // G, dim=1)
            Cm = conv_out[:, H * P + G * N:].reshape(L, G, N).repeat_interleave(H // G, dim=1)
            dt = F.softplus(dt_raw.double() + dt_bias)             # [L, H]
            S = torch.zeros(H, P, N, dtype=torch.float64)
            ys, states = [], [S.clone()]
            for t in range(L):
                S = torch.exp(dt[t] * A)[:, None, None] * S + (dt[t][:, None] * x[t])[:, :, None] * Bm[t][:, None, :]
                ys.append(torch.einsum("hpn,hn->hp", S, Cm[t]) + D[:, None] * x[t])
                states.append(S.clone())
            self.y.append(torch.stack(ys).reshape(L, H * P) if L else torch.zeros(0, H * P, dtype=torch.float64))
            self.ssm.append(torch.stack(states))
            self.conv.append(ext.unfold(0, K - 1, 1).clone())      # [L + 1, conv_dim, K - 1]
