"""The Gated DeltaNet layer (HF ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet`` names)
over a pluggable GDN backend.

The layer owns the projections, the gated RMSNorm and ``out_proj``; the backend's
:class:`~attnplug.core.gdn.GDNImpl` owns everything that touches the per-request state
(causal conv1d, gates, l2 norms, gated delta rule)::

    q k v, z, b, a = projections(h)
    o = impl(q k v, a, b)                                   # conv1d + silu + delta rule
    out = out_proj(RMSNormGated(o, z))                      # norm(o) * silu(z) per head

Two projection layouts (the only difference between the families here):

* ``qwen3_next``: ``in_proj_qkvz`` ``[2 key_dim + 2 value_dim, hidden]`` and ``in_proj_ba``
  ``[2 num_v_heads, hidden]``, rows grouped per key head: for key head ``i``, its q, k,
  then the q/k head's ``r = num_v_heads / num_k_heads`` value heads of v, then of z (and
  ``r`` rows of b then ``r`` of a).
* ``qwen3_5``: ``in_proj_qkv`` (q, k, v flat), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.

Other parameters: ``conv1d.weight`` ``[conv_dim, 1, conv_kernel_size]`` (no bias),
``dt_bias``, ``A_log`` ``[num_v_heads]``, ``norm.weight`` ``[head_v_dim]``, ``out_proj``
``[hidden, value_dim]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnplug.core.gdn import GDNBackend, GDNLayerConfig, GDNStateCache
from attnplug.runner.models.attention_op import mix_gdn
from attnplug.runner.models.impls import make_impl

PROJECTION_LAYOUTS: tuple[str, ...] = ("qwen3_next", "qwen3_5")
"""The HF projection layouts :class:`GatedDeltaNet` loads."""


class RMSNormGated(nn.Module):
    """``weight * rmsnorm(x) * silu(gate)`` per head, the statistic in float32 (HF
    ``Qwen3NextRMSNormGated``: norm first, then the gate; ``weight`` starts at 1)."""

    def __init__(self, head_size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x``, ``gate``: ``[..., head_size]``; returns ``x``'s shape and dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One GDN layer; ``layer_name`` keys its state cache and metadata.

    Args:
        layer_name: e.g. ``"model.layers.0.linear_attn"``.
        layer_cfg: the layer's :class:`GDNLayerConfig`.
        hidden_size: model width.
        norm_eps: the gated norm's epsilon (HF ``rms_norm_eps``).
        layout: ``"qwen3_next"`` or ``"qwen3_5"`` (:data:`PROJECTION_LAYOUTS`).
        backend: a :class:`GDNBackend`; its impl is built as ``Impl(layer_cfg)``.
        dtype, device: of the parameters.

    Raises:
        ValueError: an unknown ``layout``.
    """

    def __init__(self, layer_name: str, layer_cfg: GDNLayerConfig, hidden_size: int, norm_eps: float, layout: str,
                 backend: type[GDNBackend], dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        if layout not in PROJECTION_LAYOUTS:
            raise ValueError(f"GDN projection layout {layout!r}: expected one of {PROJECTION_LAYOUTS}")
        kw = dict(bias=False, dtype=dtype, device=device)
        c = layer_cfg
        self.layer_name, self.layer_cfg, self.layout = layer_name, c, layout
        if layout == "qwen3_next":
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * c.key_dim + 2 * c.value_dim, **kw)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * c.num_v_heads, **kw)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, c.conv_dim, **kw)
            self.in_proj_z = nn.Linear(hidden_size, c.value_dim, **kw)
            self.in_proj_b = nn.Linear(hidden_size, c.num_v_heads, **kw)
            self.in_proj_a = nn.Linear(hidden_size, c.num_v_heads, **kw)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel_size, groups=c.conv_dim, bias=False,
                                padding=c.conv_kernel_size - 1, dtype=dtype, device=device)
        self.dt_bias = nn.Parameter(torch.ones(c.num_v_heads, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.zeros(c.num_v_heads, dtype=dtype, device=device))
        self.norm = RMSNormGated(c.head_v_dim, norm_eps, dtype, device)
        self.out_proj = nn.Linear(c.value_dim, hidden_size, **kw)
        self.backend = backend
        self.impl = make_impl(backend, layer_name, layer_cfg)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden`` ``[n, hidden_size]`` -> ``mixed_qkv`` ``[n, conv_dim]`` (q, k, v flat),
        ``z`` ``[n, num_v_heads, head_v_dim]``, ``b``, ``a`` ``[n, num_v_heads]``."""
        c, n = self.layer_cfg, hidden.shape[0]
        if self.layout == "qwen3_5":
            return (self.in_proj_qkv(hidden), self.in_proj_z(hidden).view(n, c.num_v_heads, c.head_v_dim),
                    self.in_proj_b(hidden), self.in_proj_a(hidden))
        r = c.num_v_heads // c.num_k_heads
        qkvz = self.in_proj_qkvz(hidden).view(n, c.num_k_heads, 2 * c.head_k_dim + 2 * r * c.head_v_dim)
        q, k, v, z = qkvz.split([c.head_k_dim, c.head_k_dim, r * c.head_v_dim, r * c.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).view(n, c.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return (mixed, z.reshape(n, c.num_v_heads, c.head_v_dim), b.reshape(n, c.num_v_heads),
                a.reshape(n, c.num_v_heads))

    def forward(self, hidden: torch.Tensor, state: GDNStateCache, attn_metadata) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``.

        Reads and overwrites this step's rows of ``state`` (through the impl). Rows past
        the metadata's ``num_actual_tokens`` (padding) produce ``out_proj(0)``.
        """
        c, n = self.layer_cfg, hidden.shape[0]
        mixed, z, b, a = self.project(hidden)
        o = hidden.new_zeros((n, c.num_v_heads, c.head_v_dim))
        mix_gdn(self, mixed, a, b, state, attn_metadata, o)  # the impl; attnplug::gdn_mixer while compiling
        return self.out_proj(self.norm(o, z).reshape(n, c.value_dim))
