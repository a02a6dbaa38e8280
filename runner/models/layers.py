"""Building blocks of the Llama family: RMSNorm, RoPE, SwiGLU MLP, and the attention layer.

Numerics follow HF transformers' eager Llama code (the parity reference): RMSNorm in
float32, RoPE inverse frequencies and angles in float32 with ``cos``/``sin`` cast to the
activation dtype, the "rotate half" (non-interleaved) pairing of dimensions ``i`` and
``i + head_size / 2``.

The attention layer has exactly one attention path: its backend's ``AttentionImpl``,
called directly in eager mode and through the ``attnplug::attention`` custom op while
``torch.compile`` traces (``attention_op.attend``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnplug.core.contracts import AttentionBackend, AttentionType
from attnplug.core.errors import MetadataError
from attnplug.runner.models.attention_op import attend
from attnplug.runner.models.config import RopeScaling
from attnplug.runner.models.impls import make_impl


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, the statistic in float32 (HF ``LlamaRMSNorm``)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[num_tokens, hidden_size]``; returns the same shape and dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(head_size: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """RoPE inverse frequencies, ``[head_size // 2]``, float32, CPU.

    ``inv_freq[i] = theta ** (-2i / head_size)``, then scaled:

    * ``linear``: ``inv_freq / factor`` (equivalent to dividing positions by ``factor``).
    * ``llama3``: with ``L = original_max_position_embeddings`` and wavelength
      ``w = 2 pi / inv_freq``: ``w < L / high_freq_factor`` keeps ``inv_freq``;
      ``w > L / low_freq_factor`` uses ``inv_freq / factor``; in between it blends
      ``(1 - s) * inv_freq / factor + s * inv_freq`` with
      ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    """
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    inv_freq = 1.0 / (theta ** exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, blended, out)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys at given positions.

    ``rotary_dim`` (default ``head_size``) leading dimensions of each head are rotated
    (frequencies computed for ``rotary_dim``, HF ``partial_rotary_factor``); the rest
    pass through.
    """

    def __init__(self, head_size: int, theta: float, scaling: RopeScaling, device: torch.device | str,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = head_size if rotary_dim is None else rotary_dim
        self.register_buffer("inv_freq", rope_inv_freq(self.rotary_dim, theta, scaling).to(device), persistent=False)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """:meth:`rotate` the first ``rotary_dim`` dimensions of ``x``, keep the rest."""
        if self.rotary_dim == self.head_size:
            return self.rotate(x, cos, sin)
        r = self.rotary_dim
        return torch.cat([self.rotate(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[num_tokens]`` int64 -> ``cos``, ``sin`` ``[num_tokens, 1, rotary_dim // 2]``."""
        angles = positions.float().unsqueeze(-1) * self.inv_freq  # float32, as HF
        return angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, num_heads, head_size]``: rotate pairs ``(i, i + head_size/2)``."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` (HF ``LlamaMLP``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        kw = dict(bias=bias, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Self-attention of one decoder layer: q/k/v/o projections, RoPE, backend impl.

    The HF parameter names (``q_proj``... ``o_proj``) live here so that a state dict
    ``model.layers.N.self_attn.*`` loads directly. ``layer_name`` keys the per-layer KV
    cache and metadata dicts.
    """

    def __init__(self, layer_name: str, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_size: int, rope: RotaryEmbedding, backend: type[AttentionBackend],
                 qkv_bias: bool, o_bias: bool, sliding_window: int | None, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.layer_name = layer_name
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.q_proj = nn.Linear(hidden_size, num_heads * head_size, bias=qkv_bias, **kw)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_size, bias=qkv_bias, **kw)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_size, bias=qkv_bias, **kw)
        self.o_proj = nn.Linear(num_heads * head_size, hidden_size, bias=o_bias, **kw)
        self.rope = rope
        self.backend = backend
        self.sliding_window = sliding_window
        self.impl = make_impl(
            backend, layer_name, num_heads, head_size, head_size ** -0.5, num_kv_heads, sliding_window=sliding_window,
            logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_cache_dtype=dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``.

        Writes this step's K/V into ``kv_cache`` (through the impl) and attends.
        """
        n = hidden.shape[0]
        q = self.q_proj(hidden).view(n, self.num_heads, self.head_size)
        k = self.k_proj(hidden).view(n, self.num_kv_heads, self.head_size)
        v = self.v_proj(hidden).view(n, self.num_kv_heads, self.head_size)
        cos, sin = self.rope.cos_sin(positions, hidden.dtype)
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        out = torch.zeros_like(q)  # padded rows stay zero
        attend(self, q, k, v, kv_cache, attn_metadata, out)
        return self.o_proj(out.view(n, self.num_heads * self.head_size))


def lookup_layer(mapping, layer_name: str, what: str):
    """``mapping[layer_name]`` or a :class:`MetadataError` naming the missing layer."""
    try:
        return mapping[layer_name]
    except KeyError:
        raise MetadataError(
            f"{what} has no entry for attention layer {layer_name!r} (it has {len(mapping)} entries): "
            f"pass one per layer, keyed by the names in model.layer_names.") from None


def lookup_metadata(attn_metadata, layer_name: str):
    """:func:`lookup_layer` of ``attn_metadata`` in eager mode; ``None`` while ``torch.compile``
    traces: the compiled ops read the metadata from the forward context
    (``attention_op.forward_context``), and Dynamo, never reading it, adds no guards on it."""
    if torch.compiler.is_compiling():
        return None
    return lookup_layer(attn_metadata, layer_name, "attn_metadata")
