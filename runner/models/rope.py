"""Rotary position embedding, every variant behind one function: :func:`rope_frequencies`.

Conventions are HF transformers' (``modeling_rope_utils.py`` and the eager attention of each
family; facts, not code):

* inverse frequencies and angles in float32; ``cos``/``sin`` multiplied by the variant's
  attention factor in float32, then cast to the activation dtype;
* the rotated dimensions are the first ``rotary_dim = int(head_size * partial_rotary_factor)``
  of each head; the rest pass through unchanged;
* "rotate half" pairing (Llama, Qwen, Mistral, Gemma, gpt-oss): dimension ``i`` with
  ``i + rotary_dim / 2``;
* interleaved pairing (DeepSeek ``rope_interleave``): dimension ``2i`` with ``2i + 1``; the
  output is written de-interleaved (rotated evens, then rotated odds), as transformers'
  DeepSeek-V3 ``apply_rotary_pos_emb_interleave`` does. Queries and keys get the same
  permutation, so ``q . k`` equals the in-place pairing's.

Variants (``RopeScaling.rope_type``): ``default``, ``linear``, ``llama3``, ``yarn`` (with
``mscale`` / ``mscale_all_dim`` / ``attention_factor`` exactly as HF derives them). Dynamic
NTK is left out on purpose: its frequencies depend on the batch's longest sequence.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnplug.runner.models.config import RopeScaling


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (``1`` when ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(scaling: RopeScaling) -> float:
    """The factor DeepSeek-V2/V3 multiply their attention softmax scale by:
    ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` when the RoPE is scaled and
    ``mscale_all_dim`` is set, else ``1.0`` (HF ``yarn_apply_mscale``)."""
    if scaling.rope_type == "default" or not scaling.mscale_all_dim:
        return 1.0
    return yarn_get_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def rotary_dim_of(head_size: int, scaling: RopeScaling) -> int:
    """``int(head_size * partial_rotary_factor)``: the rotated leading dimensions of a head."""
    return int(head_size * scaling.partial_rotary_factor)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_len = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, blended, out)


def _yarn(pos_freqs: torch.Tensor, rotary_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = yarn_get_mscale(s.factor, s.mscale) / yarn_get_mscale(s.factor, s.mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(s.factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return rotary_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency (high frequencies), 0: interpolate
    interpolated = 1.0 / (s.factor * pos_freqs)  # rounded as HF rounds it
    return interpolated * (1 - extrapolate) + 1.0 / pos_freqs * extrapolate, float(attention_factor)


def rope_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """THE RoPE function: inverse frequencies and the ``cos``/``sin`` multiplier of a variant.

    ``inv_freq[i] = theta ** (-2i / rotary_dim)`` (float32), then by ``scaling.rope_type``:

    * ``default``: unchanged; attention factor 1.
    * ``linear``: ``inv_freq / factor`` (positions divided by ``factor``); factor 1.
    * ``llama3``: with ``L = original_max_position_embeddings`` and wavelength
      ``w = 2 pi / inv_freq``: ``w < L / high_freq_factor`` keeps ``inv_freq``,
      ``w > L / low_freq_factor`` uses ``inv_freq / factor``, in between
      ``(1 - s) * inv_freq / factor + s * inv_freq`` with
      ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``; factor 1.
    * ``yarn``: ``d(r) = rotary_dim * ln(L / (2 pi r)) / (2 ln theta)``; ``low = floor(d(beta_fast))``,
      ``high = ceil(d(beta_slow))`` (no rounding when ``truncate`` is false), clipped to
      ``[0, rotary_dim - 1]``; ``ramp[i] = clamp((i - low) / (high - low), 0, 1)``;
      ``inv_freq * (1 - ramp) + inv_freq / factor * ramp``. Attention factor: the config's
      ``attention_factor``, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
      when both are set, else ``mscale(factor)``, with ``mscale(s, m) = 0.1 m ln(s) + 1``
      (1 for ``s <= 1``).

    Args:
        rotary_dim: rotated dimensions per head (even; ``head_size * partial_rotary_factor``).
        theta: the RoPE base (``rope_theta``).
        scaling: the variant and its parameters.

    Returns:
        ``(inv_freq, attention_factor)``: ``[rotary_dim // 2]`` float32 on the CPU, and a float
        that multiplies ``cos`` and ``sin``.

    Raises:
        ValueError: an odd ``rotary_dim`` or an unknown ``rope_type`` (configs are checked
            earlier by ``config.parse_rope``).
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim {rotary_dim} must be a positive even number")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    pos_freqs = theta ** exponents
    inv_freq = 1.0 / pos_freqs
    kind = scaling.rope_type
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(pos_freqs, rotary_dim, theta, scaling)
    raise ValueError(f"rope_type {kind!r} is not implemented (default, linear, llama3, yarn)")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate every dimension of ``x`` ``[num_tokens, num_heads, rotary_dim]`` by the angles
    whose ``cos``/``sin`` are ``[num_tokens, 1, rotary_dim // 2]`` (same dtype as ``x``).

    Pairs ``(i, i + rotary_dim / 2)``, or ``(2i, 2i + 1)`` when ``interleaved`` (output
    de-interleaved: see the module docstring). Returns a new tensor of ``x``'s shape.
    """
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys at given positions (one instance shared by the layers
    that use the same table).

    Args:
        head_size: dimensions per head.
        theta: the RoPE base.
        scaling: the variant (:class:`RopeScaling`); its ``partial_rotary_factor`` gives the
            rotated dimensions unless ``rotary_dim`` is passed, its ``interleaved`` the pairing.
        device: where the frequency table lives.
        rotary_dim: rotated leading dimensions of each head (overrides the factor; Bamba).
    """

    def __init__(self, head_size: int, theta: float, scaling: RopeScaling, device: torch.device | str,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim_of(head_size, scaling) if rotary_dim is None else rotary_dim
        self.interleaved = scaling.interleaved
        inv_freq, self.attention_factor = rope_frequencies(self.rotary_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[num_tokens]`` int64 -> ``cos``, ``sin`` ``[num_tokens, 1, rotary_dim // 2]``
        in ``dtype`` (angles and the attention factor in float32, as HF)."""
        angles = positions.float().unsqueeze(-1) * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, num_heads, head_size]``: :func:`rotate` its first ``rotary_dim``
        dimensions, keep the rest."""
        if self.rotary_dim == self.head_size:
            return rotate(x, cos, sin, self.interleaved)
        r = self.rotary_dim
        return torch.cat([rotate(x[..., :r], cos, sin, self.interleaved), x[..., r:]], dim=-1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half pairing of all of ``x``'s dimensions (see :func:`rotate`)."""
        return rotate(x, cos, sin)


__all__ = ["RotaryEmbedding", "rope_frequencies", "rotary_dim_of", "rotate", "yarn_get_mscale", "yarn_softmax_scale"]
