"""The per-layer attention parameters a builder must know before any layer runs.

Some kernels are *planned* once per step, outside the layers: FlashInfer's ``plan()``
takes ``sm_scale``, ``window_left``, ``logits_soft_cap`` and the number of query heads;
FlashAttention 3's ``get_scheduler_metadata`` takes the head counts, the window and
whether a soft-cap is on. Those are properties of the layers' *impls*, which the
backend contract does not hand to builders (``Builder(kv_cache_spec, layer_names,
config, device)``). So each such impl registers itself here when created, and a
builder asks for the parameters of the live impls whose layer shape matches its KV-cache
spec (same KV heads, head size and window). Impls are held weakly: dropping a model
drops its entries.

Contract for drivers (the runner, the conformance harness): create the layers' impls
before the first ``build``, as they already do.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionLayerParams:
    """What a kernel plan depends on for one layer.

    Attributes:
        num_heads: query heads.
        num_kv_heads: K/V heads (``num_heads % num_kv_heads == 0``).
        head_size: features per head.
        scale: softmax scale multiplying ``q . k``.
        sliding_window: ``W`` tokens (current included) or ``None``.
        logits_soft_cap: the cap (``cap * tanh(logits / cap)``) or ``None``.
        dtype: the KV-cache dtype the impl was created for (``None``: the activation dtype).
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None
    logits_soft_cap: float | None
    dtype: torch.dtype | None = None

    @classmethod
    def from_impl(cls, impl: Any) -> "AttentionLayerParams":
        """The parameters of an :class:`~attnplug.core.contracts.AttentionImpl`."""
        return cls(int(impl.num_heads), int(impl.num_kv_heads), int(impl.head_size), float(impl.scale),
                   impl.sliding_window, impl.logits_soft_cap, impl.kv_cache_dtype)

    def sort_key(self) -> tuple:
        return (self.num_heads, self.scale, self.sliding_window or 0, self.logits_soft_cap or 0.0)


class LiveLayerParams:
    """A weak registry of live impls of one backend (see the module docstring).

    Examples:
        >>> class Impl:  # any object with an AttentionImpl's attributes
        ...     num_heads, num_kv_heads, head_size, scale = 4, 2, 8, 0.5
        ...     sliding_window = logits_soft_cap = kv_cache_dtype = None
        >>> reg, impl = LiveLayerParams(), Impl()
        >>> reg.add(impl)
        >>> [p.num_heads for p in reg.matching(num_kv_heads=2, head_size=8, sliding_window=None)]
        [4]
        >>> del impl  # dropped impls drop out
        >>> reg.matching(num_kv_heads=2, head_size=8, sliding_window=None)
        []
    """

    def __init__(self) -> None:
        self._impls: "weakref.WeakKeyDictionary[Any, AttentionLayerParams]" = weakref.WeakKeyDictionary()
        self._found: dict[tuple, list[AttentionLayerParams]] = {}
        """:meth:`matching`'s answers (builders ask every step), valid while ``_found_len``
        is the number of live impls; :meth:`add` clears them."""
        self._found_len = 0
        self.version = 0
        """Changes whenever an impl is added or dropped: a builder that derived a plan from
        :meth:`matching` may keep it while this stays the same (``int``)."""

    def add(self, impl: Any) -> None:
        """Register ``impl`` (held weakly) with its current parameters."""
        if impl not in self._impls:
            weakref.finalize(impl, self._dropped).atexit = False
        self._impls[impl] = AttentionLayerParams.from_impl(impl)
        self._found.clear()
        self.version += 1

    def _dropped(self) -> None:
        self.version += 1

    def matching(self, num_kv_heads: int, head_size: int, sliding_window: int | None) -> list[AttentionLayerParams]:
        """Distinct parameters of the live impls with this KV layout and window, sorted
        (a list the caller must not change: it is kept for the next call)."""
        n = len(self._impls)  # an impl dropped since (an add clears the answers)
        if n != self._found_len:
            self._found.clear()
            self._found_len = n
        key = (num_kv_heads, head_size, sliding_window)
        hit = self._found.get(key)
        if hit is None:
            found = {p for p in list(self._impls.values()) if p.num_kv_heads == num_kv_heads
                     and p.head_size == head_size and p.sliding_window == sliding_window}
            hit = self._found[key] = sorted(found, key=AttentionLayerParams.sort_key)
        return hit

    def for_spec(self, kv_cache_spec: Any) -> list[AttentionLayerParams]:
        """:meth:`matching` for an attention KV-cache spec (``num_kv_heads``, ``head_size``,
        and ``sliding_window`` when it is a sliding-window spec)."""
        return self.matching(int(kv_cache_spec.num_kv_heads), int(kv_cache_spec.head_size),
                             getattr(kv_cache_spec, "sliding_window", None))
