"""What the state family needs of each state kind: layer config, spec, inputs, reference.

A state case (``state_cases.StateCase``) describes its layer in Mamba2 terms; a *kind
model* maps it onto the layer of the backend's ``state_kind`` and gives everything the
harness and the checks read, so one catalog of schedules judges every kind:

* ``layer_config(case, device)``: the backend's selection input;
* ``spec(case, block_size)``: the group's :class:`~attnplug.cache_groups.specs.StateSpec`,
  its tensors declared from the layer config (what ``allocate_state_cache``, the slot
  copies and the poison work from);
* ``input_widths(case)``: the per-token inputs ``forward`` takes after ``layer``, in order;
* ``params(case, generator)``: the layer parameters the impl reads (HF names);
* ``output_shape(case)``: one token's output;
* ``reference(case, params, inputs)``: float64, token by token from zeros: outputs
  ``[L, *output_shape]`` and, per declared tensor, the state after ``t`` tokens ``[L + 1, *shape]``.

Kinds: ``"mamba2"`` (``core/mamba.py``) and ``"gdn"`` (``core/gdn.py``; the case's
``num_heads`` / ``n_groups`` / ``head_size`` / ``state_size`` are the value heads, key
heads, value head dim and key head dim).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnplug.cache_groups.specs import StateSpec, StateTensorSpec


def torch_dtype(name: str) -> torch.dtype:
    """A case's dtype name (``"float32"``, ``"float16"``, ``"bfloat16"``) as a torch dtype."""
    return getattr(torch, name)


def _conv_reference(case, w: torch.Tensor, b: torch.Tensor, x: torch.Tensor):
    """``(silu(conv out) [L, C], conv states [L + 1, C, K - 1])`` of one request, float64
    (zeros before position 0; a conv state is the last ``K - 1`` raw inputs, oldest first)."""
    K = case.conv_kernel_size
    ext = torch.cat([torch.zeros(K - 1, x.shape[1], dtype=torch.float64), x.double()])
    out = F.silu((ext.unfold(0, K, 1) * w).sum(-1) + b)
    return out, ext.unfold(0, K - 1, 1).clone()


class Mamba2Kind:
    """Mamba2 (``MambaImpl.forward(layer, hidden_states_B_C, dt, state, md, output)``)::

        conv_t  = silu(bias + sum_k weight[:, k] * xBC[t - (K - 1) + k])
        x, B, C = split(conv_t)                   # head h reads group h // (H / G)
        dt_t    = softplus(dt_raw_t + dt_bias)
        S_t     = exp(dt_t * A) * S_{t-1} + dt_t * x_t outer B_t,  A = -exp(A_log)
        y_t     = S_t @ C_t + D * x_t
    """

    state_kind = "mamba2"

    @staticmethod
    def layer_config(case, device: str):
        from attnplug.core.mamba import MambaLayerConfig

        return MambaLayerConfig(num_heads=case.num_heads, head_size=case.head_size, state_size=case.state_size,
                                n_groups=case.n_groups, conv_kernel_size=case.conv_kernel_size,
                                chunk_size=case.chunk_size, dtype=torch_dtype(case.dtype), device=str(device))

    @classmethod
    def spec(cls, case, block_size: int) -> StateSpec:
        cfg = cls.layer_config(case, "cpu")
        return StateSpec(block_size=block_size, state_kind="mamba2", chunk_size=case.chunk_size, tensors=(
            StateTensorSpec("conv_state", cfg.conv_state_shape, cfg.dtype),
            StateTensorSpec("ssm_state", cfg.ssm_state_shape, cfg.ssm_dtype)))

    @staticmethod
    def conv_dim(case) -> int:
        return case.num_heads * case.head_size + 2 * case.n_groups * case.state_size

    @classmethod
    def input_widths(cls, case) -> tuple[int, ...]:
        return cls.conv_dim(case), case.num_heads          # xBC, dt

    @classmethod
    def params(cls, case, g: torch.Generator) -> dict[str, torch.Tensor]:
        H = case.num_heads
        return dict(weight=torch.randn(cls.conv_dim(case), 1, case.conv_kernel_size, generator=g) * 0.5,
                    bias=torch.randn(cls.conv_dim(case), generator=g) * 0.1,
                    A_log=torch.log(torch.rand(H, generator=g) * 3 + 1), D=torch.rand(H, generator=g),
                    dt_bias=torch.randn(H, generator=g) * 0.5)

    @staticmethod
    def output_shape(case) -> tuple[int, ...]:
        return (case.num_heads * case.head_size,)

    @classmethod
    def reference(cls, case, p: dict[str, torch.Tensor], inputs):
        H, P, N, G = case.num_heads, case.head_size, case.state_size, case.n_groups
        xbc, dt_raw = inputs
        L = xbc.shape[0]
        conv_out, conv = _conv_reference(case, p["weight"].double().reshape(cls.conv_dim(case), -1),
                                         p["bias"].double(), xbc)
        x = conv_out[:, :H * P].reshape(L, H, P)
        Bm = conv_out[:, H * P:H * P + G * N].reshape(L, G, N).repeat_interleave(H // G, dim=1)
        Cm = conv_out[:, H * P + G * N:].reshape(L, G, N).repeat_interleave(H // G, dim=1)
        A, D = -torch.exp(p["A_log"].double()), p["D"].double()
        dt = F.softplus(dt_raw.double() + p["dt_bias"].double())
        S = torch.zeros(H, P, N, dtype=torch.float64)
        ys, states = [], [S.clone()]
        for t in range(L):
            S = torch.exp(dt[t] * A)[:, None, None] * S + (dt[t][:, None] * x[t])[:, :, None] * Bm[t][:, None, :]
            ys.append((torch.einsum("hpn,hn->hp", S, Cm[t]) + D[:, None] * x[t]).reshape(H * P))
            states.append(S.clone())
        y = torch.stack(ys) if L else torch.zeros(0, H * P, dtype=torch.float64)
        return y, (conv, torch.stack(states))


class GDNKind:
    """Gated DeltaNet (``GDNImpl.forward(layer, mixed_qkv, a, b, state, md, output)``,
    ``core/gdn.py``)::

        q, k, v = split(silu(conv(mixed_qkv)))    # key head h // (HV / HK) serves value head h
        q, k    = l2norm(q) * dk ** -0.5, l2norm(k)
        g_t     = -exp(A_log) * softplus(a_t + dt_bias),   beta_t = sigmoid(b_t)
        S_t     = exp(g_t) S_{t-1};   S_t += k_t outer beta_t (v_t - S_t^T k_t);   o_t = S_t^T q_t
    """

    state_kind = "gdn"

    @staticmethod
    def layer_config(case, device: str):
        from attnplug.core.gdn import GDNLayerConfig

        return GDNLayerConfig(num_k_heads=case.n_groups, num_v_heads=case.num_heads, head_k_dim=case.state_size,
                              head_v_dim=case.head_size, conv_kernel_size=case.conv_kernel_size,
                              chunk_size=case.chunk_size, dtype=torch_dtype(case.dtype), device=str(device))

    @classmethod
    def spec(cls, case, block_size: int) -> StateSpec:
        cfg = cls.layer_config(case, "cpu")
        return StateSpec(block_size=block_size, state_kind="gdn", chunk_size=case.chunk_size, tensors=(
            StateTensorSpec("conv_state", cfg.conv_state_shape, cfg.dtype),
            StateTensorSpec("recurrent_state", cfg.recurrent_state_shape, cfg.state_dtype)))

    @staticmethod
    def conv_dim(case) -> int:
        return 2 * case.n_groups * case.state_size + case.num_heads * case.head_size

    @classmethod
    def input_widths(cls, case) -> tuple[int, ...]:
        return cls.conv_dim(case), case.num_heads, case.num_heads     # mixed_qkv, a, b

    @classmethod
    def params(cls, case, g: torch.Generator) -> dict[str, torch.Tensor]:
        H = case.num_heads
        return dict(weight=torch.randn(cls.conv_dim(case), 1, case.conv_kernel_size, generator=g) * 0.5,
                    bias=torch.randn(cls.conv_dim(case), generator=g) * 0.1,
                    A_log=torch.log(torch.rand(H, generator=g) * 3 + 1), dt_bias=torch.randn(H, generator=g) * 0.5)

    @staticmethod
    def output_shape(case) -> tuple[int, ...]:
        return (case.num_heads, case.head_size)

    @classmethod
    def reference(cls, case, p: dict[str, torch.Tensor], inputs):
        HV, HK, dv, dk = case.num_heads, case.n_groups, case.head_size, case.state_size
        qkv, a, b = inputs
        L = qkv.shape[0]
        conv_out, conv = _conv_reference(case, p["weight"].double().reshape(cls.conv_dim(case), -1),
                                         p["bias"].double(), qkv)
        q, k, v = conv_out.split([HK * dk, HK * dk, HV * dv], dim=-1)

        def norm(x):
            x = x.reshape(L, HK, dk)
            return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(HV // HK, dim=1)

        q, k, v = norm(q) * dk ** -0.5, norm(k), v.reshape(L, HV, dv)
        gate = -torch.exp(p["A_log"].double()) * F.softplus(a.double() + p["dt_bias"].double())
        beta = torch.sigmoid(b.double())
        S = torch.zeros(HV, dk, dv, dtype=torch.float64)
        ys, states = [], [S.clone()]
        for t in range(L):
            S = torch.exp(gate[t])[:, None, None] * S
            delta = (v[t] - torch.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
            S = S + k[t][:, :, None] * delta[:, None, :]
            ys.append(torch.einsum("hkv,hk->hv", S, q[t]))
            states.append(S.clone())
        y = torch.stack(ys) if L else torch.zeros(0, HV, dv, dtype=torch.float64)
        return y, (conv, torch.stack(states))


KINDS = {k.state_kind: k for k in (Mamba2Kind, GDNKind)}
"""The state kinds the family knows, by ``StateBackend.state_kind``."""


def kind_of(backend_cls) -> type | None:
    """The kind model of a state backend (``state_kind``; an empty one is ``"mamba2"``), or
    ``None`` for a kind the family has no model of."""
    return KINDS.get(getattr(backend_cls, "state_kind", "") or "mamba2")


def display_name(tensor_name: str) -> str:
    """``"ssm_state"`` -> ``"SSM state"``, ``"conv_state"`` -> ``"conv state"`` (failure messages)."""
    return tensor_name.replace("ssm", "SSM").replace("_", " ")
