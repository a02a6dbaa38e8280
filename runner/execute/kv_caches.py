"""KV caches, once at start: negotiate each cache group's kernel block size with its
backend, then allocate every layer's cache.

``ModelRunner`` calls these; an engine that embeds the step compiler without
``ModelRunner`` calls them itself (``docs/embedding.md``)::

    kernel_block_sizes = negotiate_kernel_block_sizes(kv_cache_config, backends)
    kv_caches = allocate_kv_caches(kv_cache_config, backends, kernel_block_sizes, device)
    builders = [backend.get_builder_cls()(kernel_kv_cache_spec(group.kv_cache_spec, kbs),
                                          list(group.layer_names), builder_config, device)
                for group, backend, kbs in zip(kv_cache_config.groups, backends, kernel_block_sizes)]
    compiler = StepCompiler(kv_cache_config, ..., kernel_block_sizes=kernel_block_sizes)

Units: a *manager block* (``spec.block_size`` tokens) is what the scheduler's block pool
hands out and what ``SchedulerOutput`` block ids name; a *kernel block* (the negotiated
size, which divides the manager size) is what the backend's kernel pages by. Manager
block ``b`` covers kernel blocks ``b*k .. b*k+k-1`` with ``k = block_size //
kernel_block_size`` (``docs/architecture.md``, Conventions), so a pool of ``num_blocks``
manager blocks is a cache of ``num_blocks * k`` kernel blocks.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Sequence, Union

import torch

from attnplug.cache_groups.grouping import KVCacheConfig
from attnplug.cache_groups.kinds import GroupKind
from attnplug.cache_groups.specs import KVCacheSpec
from attnplug.core.contracts import AttentionBackend
from attnplug.core.devices import resolve_device
from attnplug.core.errors import BackendUnsupportedError, KVCacheSpecError
from attnplug.core.mamba import MambaStateCache
from attnplug.core.state import StateBackend

KVCache = Union[torch.Tensor, MambaStateCache, tuple]
"""One layer's cache: a paged K/V tensor (attention groups) or a state tuple (state groups: a
:class:`MambaStateCache` for Mamba2, one tensor per declared state tensor in general)."""


def _check_one_per_group(kv_cache_config: KVCacheConfig, what: str, values: Sequence) -> None:
    if len(values) != len(kv_cache_config.groups):
        raise KVCacheSpecError(f"{len(values)} {what} for {len(kv_cache_config.groups)} cache groups: "
                               f"pass one per group of kv_cache_config.groups, in group order")


def negotiate_kernel_block_sizes(kv_cache_config: KVCacheConfig,
                                 backends: Sequence[type[AttentionBackend]]) -> list[int]:
    """The kernel block size of each cache group: what its backend pages by.

    Group ``g``'s size is ``backends[g].get_supported_kernel_block_size(block_size)`` for
    the group's manager ``block_size`` (tokens): the manager size itself when the backend
    accepts any size (``supported_kernel_block_sizes is None``) or lists it, else the
    largest listed size that divides it.

    Args:
        kv_cache_config: the cache groups (``groups[g].kv_cache_spec.block_size``).
        backends: one backend class per group, in group order.

    Returns:
        ``[kernel_block_size per group]`` (tokens, Python ints); each divides its group's
        manager ``block_size``. Pass the list to ``StepCompiler(kernel_block_sizes=...)``,
        :func:`allocate_kv_caches` and :func:`kernel_kv_cache_spec`.

    Raises:
        BackendUnsupportedError: a backend lists no kernel block size that divides its
            group's block size (or returns one that does not divide it); the message names
            the group and the sizes.
        KVCacheSpecError: not one backend per group.
    """
    _check_one_per_group(kv_cache_config, "backends", backends)
    sizes: list[int] = []
    for g, (group, backend) in enumerate(zip(kv_cache_config.groups, backends)):
        block_size = group.kv_cache_spec.block_size
        kbs = backend.get_supported_kernel_block_size(block_size)
        if kbs is None:
            raise BackendUnsupportedError(backend.get_name(), [
                f"block_size {block_size} is not a multiple of any kernel "
                f"block size {list(backend.supported_kernel_block_sizes or ())}"], f"cache group {g}")
        if kbs <= 0 or block_size % kbs:
            raise BackendUnsupportedError(backend.get_name(), [
                f"get_supported_kernel_block_size({block_size}) returned {kbs!r}, which does not "
                f"divide the block size"], f"cache group {g}")
        sizes.append(int(kbs))
    return sizes


def kernel_kv_cache_spec(spec: KVCacheSpec, kernel_block_size: int) -> KVCacheSpec:
    """The spec a group's metadata builder is created with: ``spec`` with ``block_size``
    set to the negotiated ``kernel_block_size`` (``spec`` itself when they are equal).

    Builders see kernel blocks: the step compiler's ``block_table_tensor`` holds kernel
    block ids, and ``slot_mapping`` is ``kernel_block_id * kernel_block_size + offset``.
    """
    return spec if kernel_block_size == spec.block_size else dataclasses.replace(spec, block_size=kernel_block_size)


def allocate_kv_caches(kv_cache_config: KVCacheConfig, backends: Sequence[type[AttentionBackend]],
                       kernel_block_sizes: Sequence[int],
                       device: torch.device | str = "cpu") -> dict[str, KVCache]:
    """Allocate every layer's cache, zero-filled, one tensor (or state) per layer.

    * Attention groups (``AttentionSpec``): a tensor of
      ``backend.get_kv_cache_shape(num_blocks * k, kernel_block_size, num_kv_heads,
      head_size)`` with ``k = block_size // kernel_block_size`` and ``num_blocks =
      kv_cache_config.num_blocks_of(g)`` — for the default layout ``[num_kernel_blocks, 2,
      kernel_block_size, num_kv_heads, head_size]`` (K at index 0 of dim 1, V at 1), dtype
      ``spec.dtype``. Kernel blocks ``0 .. k-1`` are manager block 0, the null block,
      which the block pool never hands to a request.
    * State groups (``spec.kind is GroupKind.MAMBA``: Mamba2, GDN, any
      :class:`~attnplug.cache_groups.specs.StateSpec`): ``backend.allocate_state_cache(spec,
      num_blocks_of(g), device)``, one state slot per block id: a tuple with one
      ``[num_slots, *shape]`` tensor per tensor the spec declares (a
      :class:`~attnplug.core.mamba.MambaStateCache` for Mamba2).

    Memory: with the default layout, each layer of group ``g`` takes ``num_blocks_of(g) *
    spec.page_size_bytes`` bytes (Mamba: ``num_blocks_of(g)`` slots of
    ``page_size_bytes``); layers never share storage.

    Args:
        kv_cache_config: the cache groups and pool sizes.
        backends: one backend class per group, in group order.
        kernel_block_sizes: per group, from :func:`negotiate_kernel_block_sizes`.
        device: where the caches live (``"cuda"`` means the current CUDA device).

    Returns:
        ``{layer_name: cache}`` for every layer of every group, in group order; the model
        passes ``kv_caches[layer_name]`` to that layer's impl ``forward``.

    Raises:
        BackendUnsupportedError: a state group whose backend is not a
            :class:`~attnplug.core.state.StateBackend` (it cannot allocate state slots).
        KVCacheSpecError: not one backend and one kernel block size per group, or a kernel
            block size that does not divide its group's block size.
    """
    _check_one_per_group(kv_cache_config, "backends", backends)
    _check_one_per_group(kv_cache_config, "kernel block sizes", kernel_block_sizes)
    device = resolve_device(device)
    caches: dict[str, KVCache] = {}
    for g, (group, backend, kbs) in enumerate(zip(kv_cache_config.groups, backends, kernel_block_sizes)):
        spec = group.kv_cache_spec
        num_blocks = kv_cache_config.num_blocks_of(g)
        if spec.kind is GroupKind.MAMBA:
            if not isinstance(backend, type) or not issubclass(backend, StateBackend):
                raise BackendUnsupportedError(backend.get_name(), [
                    "cache group is a Mamba state group but the backend is not a MambaBackend "
                    "(a StateBackend: it cannot allocate state slots)"], f"cache group {g}")
            for name in group.layer_names:
                caches[name] = backend.allocate_state_cache(spec, num_blocks, device)
            continue
        try:
            kbs = operator.index(kbs)
        except TypeError:
            kbs = None
        if kbs is None or kbs <= 0 or spec.block_size % kbs:
            raise KVCacheSpecError(f"cache group {g}: kernel block size {kernel_block_sizes[g]!r} does not divide "
                                   f"the block size {spec.block_size} (use negotiate_kernel_block_sizes)")
        num_kernel_blocks = num_blocks * (spec.block_size // kbs)
        shape = backend.get_kv_cache_shape(num_kernel_blocks, kbs, spec.num_kv_heads, spec.head_size)
        for name in group.layer_names:
            caches[name] = torch.zeros(shape, dtype=spec.dtype, device=device)
    return caches
