"""The Gated DeltaNet (GDN) side of the backend contract: linear-attention state layers.

A GDN layer (Qwen3-Next, Qwen3.5) keeps, per request, a conv state
``[conv_dim, conv_kernel_size - 1]`` (the short causal conv over q, k and v) and a
recurrent state ``[num_v_heads, head_k_dim, head_v_dim]`` in float32. With ``q_t``, ``k_t``
l2-normalised over ``head_k_dim`` (``q_t`` then scaled by ``head_k_dim ** -0.5``), the
log decay ``g_t = -exp(A_log) * softplus(a_t + dt_bias) <= 0`` and the write strength
``beta_t = sigmoid(b_t)``, the gated delta rule is, per value head (Yang et al., "Gated
Delta Networks", 2024; the facts of transformers' ``torch_recurrent_gated_delta_rule``)::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t outer (beta_t * (v_t - S_t^T k_t))        # the delta-rule write
    o_t = S_t^T q_t                                             # [head_v_dim]

Query/key head ``h // (num_v_heads // num_k_heads)`` serves value head ``h``.

* :class:`GDNLayerConfig` — what a GDN layer needs of a backend (selection input).
* :class:`GDNStateCache` — one layer's ``(conv_state, recurrent_state)`` for every slot.
* :class:`GDNBackend` — a :class:`~attnplug.core.state.StateBackend` with ``state_kind = "gdn"``.
* :class:`GDNImpl` — runs the state-touching part of a layer (conv, gates, delta rule).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from attnplug.core.state import StateBackend, StateLayerConfig

GDN_STATE_DTYPE = torch.float32
"""The recurrent state is kept in float32 whatever the activation dtype (HF and
flash-linear-attention accumulate it in float32)."""


@dataclass(frozen=True)
class GDNLayerConfig(StateLayerConfig):
    """What a Gated DeltaNet layer needs of a backend (``state_kind = "gdn"``).

    ``conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim`` channels (q, k,
    v in that order) go through the depthwise causal conv1d; ``chunk_size`` is the chunk
    length of the prefill scan (64 in transformers and flash-linear-attention).
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int
    chunk_size: int = 64
    dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = GDN_STATE_DTYPE
    block_size: int = 16
    activation: str = "silu"
    device: str = "cpu"
    state_kind: ClassVar[str] = "gdn"

    @property
    def key_dim(self) -> int:
        """``num_k_heads * head_k_dim`` (channels of q, and of k)."""
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        """``num_v_heads * head_v_dim`` (channels of v, of the gate z and of the output)."""
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv1d: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """``(conv_dim, conv_kernel_size - 1)``: the last inputs, oldest first."""
        return (self.conv_dim, self.conv_kernel_size - 1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """``(num_v_heads, head_k_dim, head_v_dim)``."""
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


class GDNStateCache(NamedTuple):
    """One GDN layer's state, for every slot of the group's pool (slot 0 never used)."""

    conv_state: torch.Tensor
    """``[num_slots, conv_dim, conv_kernel_size - 1]``, the layer dtype; column ``j`` holds
    input ``t - (conv_kernel_size - 1) + j`` before the next token ``t`` (oldest first)."""

    recurrent_state: torch.Tensor
    """``[num_slots, num_v_heads, head_k_dim, head_v_dim]``, float32: ``S`` after the
    request's last computed token."""


class GDNBackend(StateBackend):
    """Base of backends that serve GDN state groups (``kv_cache_kind = "mamba"``,
    ``state_kind = "gdn"``); the impl class is a :class:`GDNImpl`, built as
    ``Impl(layer_config)``; one layer's cache is a :class:`GDNStateCache`."""

    state_kind: ClassVar[str] = "gdn"
    state_cache_cls: ClassVar[type] = GDNStateCache
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    supported_state_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)

    @classmethod
    def validate_configuration(cls, layer: Any) -> list[str]:
        """Every reason this backend cannot serve ``layer`` (a :class:`GDNLayerConfig`);
        fields a config does not carry are not checked."""
        reasons = super().validate_configuration(layer)
        state_dtype = getattr(layer, "state_dtype", None)
        if state_dtype is not None and state_dtype not in cls.supported_state_dtypes:
            reasons.append(f"recurrent state dtype {state_dtype} not supported (supported: "
                           f"{', '.join(str(d) for d in cls.supported_state_dtypes)})")
        act = getattr(layer, "activation", None)
        if act is not None and act not in ("silu", "swish"):
            reasons.append(f"conv activation {act!r} not supported (supported: ['silu', 'swish'])")
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size", "chunk_size"):
            v = getattr(layer, name, None)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                reasons.append(f"{name} must be a positive int, got {v!r}")
        nk, nv = getattr(layer, "num_k_heads", None), getattr(layer, "num_v_heads", None)
        if isinstance(nk, int) and isinstance(nv, int) and nk > 0 and nv % nk:
            reasons.append(f"num_v_heads {nv} is not a multiple of num_k_heads {nk}")
        return reasons


class GDNImpl(ABC):
    """Runs the state-touching part of one GDN layer with its builder's metadata.

    ``Impl(layer_config)``. The calling layer keeps the projections, the gated RMSNorm
    and ``out_proj``; the impl does the causal conv1d over q/k/v (with the conv state),
    the gates, the l2 norms and the gated delta rule (with the recurrent state), and
    writes both states back to the requests' slots.
    """

    def __init__(self, layer_config: GDNLayerConfig):
        self.layer_config = layer_config

    @abstractmethod
    def forward(self, layer: Any, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                state: GDNStateCache, attn_metadata: Any, output: torch.Tensor) -> torch.Tensor:
        """One step of one layer, for every scheduled token.

        Args:
            layer: the calling module; reads ``layer.conv1d.weight`` (``[conv_dim, 1,
                conv_kernel_size]``), ``layer.conv1d.bias`` (``[conv_dim]`` or ``None``),
                ``layer.A_log`` and ``layer.dt_bias`` (``[num_v_heads]``), HF
                ``Qwen3NextGatedDeltaNet`` names.
            mixed_qkv: ``[num_tokens, conv_dim]``, the layer dtype: q, k, v (flat, in that
                order) before the conv, tokens in batch-row order.
            a: ``[num_tokens, num_v_heads]``: the decay input (``g = -exp(A_log) *
                softplus(a + dt_bias)``).
            b: ``[num_tokens, num_v_heads]``: the write-strength input (``beta = sigmoid(b)``).
            state: this layer's :class:`GDNStateCache`; the rows of this step's slots are
                read (when ``has_initial_state``) and overwritten.
            attn_metadata: what the group's builder returned this step.
            output: ``[num_tokens, num_v_heads, head_v_dim]``, written in place for the
                first ``num_actual_tokens`` rows (``o_t``, before the gated norm).

        Returns:
            ``output``.

        Must not synchronise with the host (no ``.item()``/``.tolist()``): runs per layer.
        """
