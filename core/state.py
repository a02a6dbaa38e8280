"""The state side of the backend contract, common to every recurrent-state kind.

A state cache group (``GroupKind.MAMBA``) keeps one *state slot* per running request
instead of paged K/V. What a slot holds is declared by the group's spec
(``attnplug.cache_groups.specs.StateSpec``: named tensors with shapes and dtypes, and a
``state_kind`` such as ``"mamba2"`` or ``"gdn"``). This module gives the pieces every
kind shares:

* :class:`StateLayerConfig` — the base of a state layer's config (selection input); its
  ``state_kind`` names the layer math.
* :class:`StateBackend` — an :class:`~attnplug.core.contracts.AttentionBackend` with
  ``kv_cache_kind = "mamba"`` (state groups) and a ``state_kind``: it serves only layers
  of that kind, and allocates each layer's state from the spec's declaration
  (:meth:`StateBackend.allocate_state_cache`).

A layer's state cache is a tuple of tensors ``[num_slots, *shape]``, one per declared
tensor in declaration order (a kind may use a ``NamedTuple`` for named access, e.g.
``MambaStateCache(conv_state, ssm_state)``); code that works on any kind (slot copies
for prefix caching, conformance poison) iterates over the tuple.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from attnplug.core.contracts import AttentionBackend
from attnplug.core.errors import KVCacheSpecError


class StateLayerConfig:
    """Mixin of every state layer config: ``state_kind`` names the layer math (``"mamba2"``,
    ``"gdn"``); a :class:`StateBackend` serves only layers of its own kind."""

    state_kind: ClassVar[str] = ""


class StateBackend(AttentionBackend):
    """Base of backends that serve state groups (``kv_cache_kind = "mamba"``).

    Subclasses set ``state_kind`` (the layer math they implement), ``state_cache_cls``
    (the tuple type of one layer's cache; built as ``state_cache_cls(*tensors)``) and name
    their builder and impl.
    """

    kv_cache_kind: ClassVar[str] = "mamba"
    state_kind: ClassVar[str] = ""
    """The layer math this backend implements; must equal the spec's / layer config's."""
    state_cache_cls: ClassVar[type] = tuple
    """``state_cache_cls(*tensors)`` is one layer's cache (default: a plain tuple)."""
    supported_state_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    """Dtypes a declared state tensor may have (``None``: any)."""
    supports_draft_verification: ClassVar[bool] = False
    """The builder and impl serve verifying rows (speculative decoding): for a row with ``d``
    drafts (``CommonAttentionMetadata.num_draft_tokens_cpu``) they leave the state after its
    first ``j + 1`` tokens in block-table column ``j``, ``j = 0 .. d``
    (docs/mamba-state-backends.md, "Speculative decoding on a state group"). A model whose
    state groups' backends do not declare it refuses ``--speculative``."""

    @classmethod
    def supports_mqa_gqa(cls) -> bool:
        """Attention-only features (windows, soft-cap, GQA) do not apply to state layers."""
        return False

    @classmethod
    def allocate_state_cache(cls, kv_cache_spec: Any, num_slots: int, device: torch.device | str) -> tuple:
        """Allocate one layer's state for ``num_slots`` slots, zero-filled, from the declaration.

        The model runner calls this for every layer of a state group, with ``num_slots`` =
        the group pool's ``num_blocks`` (slot ids are block ids).

        Args:
            kv_cache_spec: the group's :class:`~attnplug.cache_groups.specs.StateSpec`
                (``tensors``: name, shape, dtype each; ``state_kind``).
            num_slots: slots to allocate (``>= 2``; slot 0 is the reserved null block).
            device: where the state lives.

        Returns:
            ``state_cache_cls(*tensors)``: per declared tensor ``t``, a zero tensor
            ``[num_slots, *t.shape]`` of ``t.dtype``, in declaration order.

        Raises:
            KVCacheSpecError: the spec's ``state_kind`` is not this backend's.
        """
        kind = getattr(kv_cache_spec, "state_kind", None)
        if cls.state_kind and kind != cls.state_kind:
            raise KVCacheSpecError(f"backend {cls.get_name()!r} serves {cls.state_kind!r} state, the spec declares {kind!r}")
        tensors = [torch.zeros((num_slots, *t.shape), dtype=t.dtype, device=device) for t in kv_cache_spec.tensors]
        return tuple(tensors) if cls.state_cache_cls is tuple else cls.state_cache_cls(*tensors)

    @classmethod
    def validate_configuration(cls, layer: Any) -> list[str]:
        """Every reason this backend cannot serve ``layer`` (a :class:`StateLayerConfig`):
        availability, another ``state_kind``, dtype, device.

        Fields a config does not carry are not checked (selection may describe a layer
        from an HF config before the model is built).
        """
        reasons: list[str] = []
        ok, why = cls.is_available()
        if not ok:
            reasons.append(f"not available on this machine: {why}")
        kind = getattr(layer, "state_kind", None)
        if kind and cls.state_kind and kind != cls.state_kind:
            reasons.append(f"serves {cls.state_kind!r} state layers, not {kind!r}")
        dtype = getattr(layer, "dtype", None)
        if dtype is not None and dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {dtype} not supported (supported: "
                           f"{', '.join(str(d) for d in cls.supported_dtypes)})")
        dev = torch.device(getattr(layer, "device", "cpu")).type
        if dev not in cls.supported_devices:
            reasons.append(f"device {dev!r} not supported (supported: {list(cls.supported_devices)})")
        elif dev == "cuda" and not torch.cuda.is_available():
            reasons.append("device 'cuda' requested but torch.cuda.is_available() is False")
        return reasons
