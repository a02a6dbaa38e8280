"""The runner's side of Mamba prefix caching: copy state slots as a step asks.

``SchedulerOutput.mamba_state_copies`` (``runner/serve/mamba_checkpoints.py``) lists, per
Mamba group ``g``, ``(g, src_slot, dst_slot)`` pairs: *restores* run before the step's
forward (a prefix hit's checkpoint into the request's own slot), *saves* after it (the
request's slot, now the state after a multiple of the Mamba block size, into a checkpoint
slot). A copy moves every declared state tensor of every layer of the group (a layer's cache is
a tuple of ``[num_slots, ...]`` tensors: ``conv_state`` and ``ssm_state`` for Mamba2,
``conv_state`` and ``recurrent_state`` for GDN).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from attnplug.core.errors import MetadataError


def copy_state_slots(kv_caches: Mapping[str, object], layer_names: Sequence[Sequence[str]],
                     copies: Iterable[tuple[int, int, int]]) -> int:
    """Copy slot ``src`` to ``dst`` in every Mamba layer of group ``g``, for each ``(g, src, dst)``.

    Args:
        kv_caches: ``{layer_name: cache}``; a state layer's cache is a tuple of tensors
            ``[num_slots, ...]`` (any device), e.g. ``MambaStateCache``.
        layer_names: per group, its layers.
        copies: the pairs, applied in order (indices ``[src] -> [dst]`` along dim 0).

    Returns:
        Copies applied.

    Raises:
        MetadataError: a group without state caches, or a slot outside ``[1, num_slots)``.
    """
    n = 0
    for g, src, dst in copies:
        for name in layer_names[g]:
            cache = kv_caches[name]
            if not isinstance(cache, tuple) or not cache or not all(isinstance(t, torch.Tensor) for t in cache):
                raise MetadataError(f"mamba_state_copies: group {g} layer {name!r} has no state cache")
            slots = cache[0].shape[0]
            if not (0 < src < slots and 0 < dst < slots):
                raise MetadataError(f"mamba_state_copies: slots {src} -> {dst} outside [1, {slots}) in group {g}")
            for t in cache:
                t[dst].copy_(t[src])
        n += 1
    return n


@torch.inference_mode()
def apply_state_copies(runner, scheduler_output, when: str) -> None:
    """``when`` = ``"restores"`` (before the forward) or ``"saves"`` (after) of the step."""
    copies = getattr(scheduler_output, "mamba_state_copies", None)
    if copies:
        names = [g.layer_names for g in runner.kv_cache_config.groups]
        copy_state_slots(runner.kv_caches, names, getattr(copies, when))
