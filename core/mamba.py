"""The Mamba side of the backend contract: state-slot backends and their layers.

A Mamba cache group keeps one *state slot* per running request instead of paged K/V:
slot ``s`` of a layer holds that request's conv state ``[conv_dim, conv_kernel_size - 1]``
and SSM state ``[num_heads, head_size, state_size]``. The group's block table has one
block per request and that block id IS the slot id (``MambaStateManager`` hands it out
on admission and takes it back on finish or preemption).

* :class:`MambaLayerConfig` — what a Mamba2 layer needs of a backend (selection input).
* :class:`MambaStateCache` — one layer's state tensors, indexed by slot id.
* :class:`MambaBackend` — an :class:`~attnplug.core.contracts.AttentionBackend` with
  ``kv_cache_kind = "mamba"``: validates :class:`MambaLayerConfig` and allocates each
  layer's :class:`MambaStateCache` (:meth:`MambaBackend.allocate_state_cache`, the hook
  the model runner calls instead of ``get_kv_cache_shape``).
* :class:`MambaImpl` — runs a layer's state-touching part (causal conv1d + SSM scan).

Shapes and names follow the Mamba2 paper / ``mamba_ssm`` (``nheads``, ``headdim``,
``d_state``, ``ngroups``, ``d_conv``) under attnplug's spelling (``num_heads``,
``head_size``, ``state_size``, ``n_groups``, ``conv_kernel_size``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from attnplug.core.state import StateBackend, StateLayerConfig

SUPPORTED_MAMBA_ACTIVATIONS: tuple[str, ...] = ("silu", "swish")
"""Activations of the causal conv1d a Mamba2 layer may ask for (``swish`` == ``silu``)."""


@dataclass(frozen=True)
class MambaLayerConfig(StateLayerConfig):
    """What a Mamba2 mixer layer needs of a backend (``state_kind = "mamba2"``).

    ``conv_dim = num_heads * head_size + 2 * n_groups * state_size`` channels go through
    the causal conv1d (x, B and C); head ``h`` reads B/C group ``h // (num_heads //
    n_groups)``. ``time_step_limit`` clamps ``dt`` after ``softplus(dt + dt_bias)``
    (inclusive bounds, HF ``config.time_step_limit``).
    """

    num_heads: int
    head_size: int
    state_size: int
    n_groups: int
    conv_kernel_size: int
    chunk_size: int
    dtype: torch.dtype = torch.float32
    ssm_dtype: torch.dtype = torch.float32
    block_size: int = 16
    activation: str = "silu"
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    device: str = "cpu"
    state_kind: ClassVar[str] = "mamba2"

    @property
    def intermediate_size(self) -> int:
        """``num_heads * head_size`` (channels of x, of the gate z and of the output)."""
        return self.num_heads * self.head_size

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv1d: x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """``(conv_dim, conv_kernel_size - 1)``: the last inputs, oldest first."""
        return (self.conv_dim, self.conv_kernel_size - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        """``(num_heads, head_size, state_size)``."""
        return (self.num_heads, self.head_size, self.state_size)


class MambaStateCache(NamedTuple):
    """One Mamba layer's state, for every slot of the group's pool.

    Row ``NULL_BLOCK_ID`` (0) is never handed to a request; rows of finished requests
    hold stale values that no step reads (a new owner starts with
    ``has_initial_state = False``).
    """

    conv_state: torch.Tensor
    """``[num_slots, conv_dim, conv_kernel_size - 1]``, ``MambaSpec.dtype``, compute
    device; column ``j`` holds input ``t - (conv_kernel_size - 1) + j`` before the next
    token ``t`` (oldest first)."""

    ssm_state: torch.Tensor
    """``[num_slots, num_heads, head_size, state_size]``, ``MambaSpec.ssm_dtype``, compute
    device; the SSM state after the request's last computed token."""


class MambaBackend(StateBackend):
    """Base of backends that serve Mamba2 state groups (``kv_cache_kind = "mamba"``,
    ``state_kind = "mamba2"``).

    Subclasses name their builder and impl (``get_builder_cls``, ``get_impl_cls``) and
    may override :meth:`allocate_state_cache` (a different state layout) and
    :meth:`validate_configuration` (call ``super()``). The impl class is a
    :class:`MambaImpl`, built as ``Impl(layer_config)``. The default allocation is
    :meth:`StateBackend.allocate_state_cache` over the spec's declared tensors
    (``conv_state`` then ``ssm_state``), as a :class:`MambaStateCache`.
    """

    state_kind: ClassVar[str] = "mamba2"
    state_cache_cls: ClassVar[type] = MambaStateCache
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    supported_ssm_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    """SSM state dtypes the backend accepts."""

    @classmethod
    def allocate_state_cache(cls, kv_cache_spec: Any, num_slots: int,
                             device: torch.device | str) -> MambaStateCache:
        """Allocate one layer's state for ``num_slots`` slots, zero-filled.

        The model runner calls this for every layer of a ``"mamba"`` cache group, with
        ``num_slots`` = the group pool's ``num_blocks`` (slot ids are block ids).

        Args:
            kv_cache_spec: the group's :class:`~attnplug.cache_groups.specs.MambaSpec`
                (declares ``conv_state`` ``[conv_dim, conv_kernel_size - 1]`` in ``dtype``
                and ``ssm_state`` ``[num_heads, head_size, state_size]`` in ``ssm_dtype``).
            num_slots: slots to allocate (``>= 2``; slot 0 is the reserved null block).
            device: where the state lives.

        Returns:
            The :class:`MambaStateCache` (``[num_slots, *conv_state_shape]`` and
            ``[num_slots, *ssm_state_shape]``).
        """
        return super().allocate_state_cache(kv_cache_spec, num_slots, device)

    @classmethod
    def validate_configuration(cls, layer: Any) -> list[str]:
        """Every reason this backend cannot serve ``layer`` (a :class:`MambaLayerConfig`).

        Fields a config does not carry are not checked (selection may describe a layer
        from an HF config before the model is built).
        """
        reasons = super().validate_configuration(layer)
        ssm_dtype = getattr(layer, "ssm_dtype", None)
        if ssm_dtype is not None and ssm_dtype not in cls.supported_ssm_dtypes:
            reasons.append(f"ssm state dtype {ssm_dtype} not supported (supported: "
                           f"{', '.join(str(d) for d in cls.supported_ssm_dtypes)})")
        act = getattr(layer, "activation", None)
        if act is not None and act not in SUPPORTED_MAMBA_ACTIVATIONS:
            reasons.append(f"conv activation {act!r} not supported (supported: {list(SUPPORTED_MAMBA_ACTIVATIONS)})")
        for name in ("num_heads", "head_size", "state_size", "n_groups", "conv_kernel_size", "chunk_size"):
            v = getattr(layer, name, None)
            if v is not None and (not isinstance(v, int) or v <= 0):
                reasons.append(f"{name} must be a positive int, got {v!r}")
        heads, groups = getattr(layer, "num_heads", None), getattr(layer, "n_groups", None)
        if isinstance(heads, int) and isinstance(groups, int) and groups > 0 and heads % groups:
            reasons.append(f"num_heads {heads} is not a multiple of n_groups {groups}")
        return reasons


class MambaImpl(ABC):
    """Runs the state-touching part of one Mamba2 layer with its builder's metadata.

    ``Impl(layer_config)``. The calling layer keeps the projections (``in_proj``,
    gated norm, ``out_proj``); the impl does causal conv1d over x/B/C (with the conv
    state), the SSM scan (with the SSM state), and the ``D`` skip, then writes both
    states back to the requests' slots.
    """

    def __init__(self, layer_config: MambaLayerConfig):
        self.layer_config = layer_config

    @abstractmethod
    def forward(self, layer: Any, hidden_states_B_C: torch.Tensor, dt: torch.Tensor,
                state: MambaStateCache, attn_metadata: Any, output: torch.Tensor) -> torch.Tensor:
        """One step of one layer, for every scheduled token.

        Args:
            layer: the calling module; reads ``layer.conv1d.weight`` (``[conv_dim, 1,
                conv_kernel_size]``), ``layer.conv1d.bias`` (``[conv_dim]`` or ``None``),
                ``layer.A_log``, ``layer.D``, ``layer.dt_bias`` (each ``[num_heads]``; the
                decay rate is ``A = -exp(A_log)``), HF ``BambaMixer`` names.
            hidden_states_B_C: ``[num_tokens, conv_dim]``, the layer dtype, compute
                device; x, B, C before the conv, tokens in batch-row order.
            dt: ``[num_tokens, num_heads]``, raw time steps (before ``+ dt_bias`` and
                ``softplus``).
            state: this layer's :class:`MambaStateCache`; the rows of this step's slots
                are read (when ``has_initial_state``) and overwritten.
            attn_metadata: what the group's builder returned this step.
            output: ``[num_tokens, num_heads * head_size]``, written in place for the
                first ``num_actual_tokens`` rows: ``y = SSM(x) + D * x`` (not yet gated).

        Returns:
            ``output``.

        Must not synchronise with the host (no ``.item()``/``.tolist()``): runs per layer.
        """
