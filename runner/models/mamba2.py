"""The Mamba2 mixer layer (HF ``BambaMixer`` parameter names) over a pluggable Mamba backend.

The layer owns the projections and the gated norm; the backend's
:class:`~attnplug.core.mamba.MambaImpl` owns everything that touches the per-request
state (causal conv1d, SSM scan, ``D`` skip)::

    [gate z | x B C | dt] = in_proj(h)
    y = impl(x B C, dt)                                   # conv1d + silu + SSM + D*x
    out = out_proj(GatedRMSNorm(y, z))                    # norm(y * silu(z)) per group

Parameters: ``in_proj`` ``[intermediate + conv_dim + num_heads, hidden]``, ``conv1d.weight``
``[conv_dim, 1, conv_kernel_size]`` (+ ``conv1d.bias``), ``dt_bias``, ``A_log``, ``D``
``[num_heads]``, ``norm.weight`` ``[intermediate]``, ``out_proj`` ``[hidden, intermediate]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnplug.core.mamba import MambaBackend, MambaLayerConfig, MambaStateCache
from attnplug.runner.models.attention_op import mix
from attnplug.runner.models.impls import make_impl


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm_per_group(y * silu(z))`` in float32 (HF ``BambaRMSNormGated``,
    gate applied before the norm; groups of ``group_size`` channels)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x``, ``gate``: ``[num_tokens, hidden_size]``; returns ``x``'s shape and dtype."""
        n = x.shape[0]
        h = (x.float() * F.silu(gate.float())).view(n, -1, self.group_size)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.view(n, -1).to(x.dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba2 mixer; ``layer_name`` keys its state cache and metadata.

    Args:
        layer_name: e.g. ``"model.layers.0.mamba"``.
        layer_cfg: the layer's :class:`MambaLayerConfig` (dims, chunk size, dtypes).
        hidden_size: model width.
        conv_bias, proj_bias: HF ``mamba_conv_bias`` / ``mamba_proj_bias``.
        norm_eps: the gated norm's epsilon (HF ``rms_norm_eps``).
        backend: a :class:`MambaBackend`; its impl is built as ``Impl(layer_cfg)``.
        dtype, device: of the parameters.
    """

    def __init__(self, layer_name: str, layer_cfg: MambaLayerConfig, hidden_size: int, conv_bias: bool,
                 proj_bias: bool, norm_eps: float, backend: type[MambaBackend], dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        c = layer_cfg
        self.layer_name = layer_name
        self.layer_cfg = c
        self.in_proj = nn.Linear(hidden_size, c.intermediate_size + c.conv_dim + c.num_heads, bias=proj_bias, **kw)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel_size, groups=c.conv_dim, bias=conv_bias,
                                padding=c.conv_kernel_size - 1, **kw)
        self.dt_bias = nn.Parameter(torch.ones(c.num_heads, **kw))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, c.num_heads + 1, dtype=torch.float32)).to(**kw))
        self.D = nn.Parameter(torch.ones(c.num_heads, **kw))
        self.norm = GatedRMSNorm(c.intermediate_size, c.intermediate_size // c.n_groups, norm_eps, dtype, device)
        self.out_proj = nn.Linear(c.intermediate_size, hidden_size, bias=proj_bias, **kw)
        self.backend = backend
        self.impl = make_impl(backend, layer_name, layer_cfg)

    def forward(self, hidden: torch.Tensor, state: MambaStateCache, attn_metadata) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``.

        Reads and overwrites this step's rows of ``state`` (through the impl). Rows past
        the metadata's ``num_actual_tokens`` (padding) produce ``out_proj(0)``.
        """
        c = self.layer_cfg
        gate, xbc, dt = self.in_proj(hidden).split([c.intermediate_size, c.conv_dim, c.num_heads], dim=-1)
        y = hidden.new_zeros((hidden.shape[0], c.intermediate_size))
        mix(self, xbc, dt, state, attn_metadata, y)  # the impl; attnplug::mamba_mixer while compiling
        return self.out_proj(self.norm(y, gate))
