"""Cache groups: layers with equal specs share one block table and one block pool.

``group_layers_by_spec`` turns a model's ``{layer_name: spec}`` into ordered
:class:`KVCacheGroupSpec` s (vLLM's ``KVCacheGroupSpec``); ``KVCacheConfig`` adds the
block count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from attnplug.cache_groups.kinds import GroupKind
from attnplug.cache_groups.specs import KVCacheSpec
from attnplug.core.errors import KVCacheSpecError


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """A cache group: the layers (in model order) that share ``kv_cache_spec``."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The whole model's cache: ``num_blocks`` per group's pool, and the groups.

    ``num_state_slots`` (optional) sizes the pools of Mamba state groups (``kind ==
    "mamba"``) instead: a request holds one slot there whatever its length, so
    ``max_num_seqs + 1`` slots (the null block included) suffice, while each slot holds a
    whole request's state. ``None``: ``num_blocks`` like every other group.

    ``state_slots_per_request`` (default 1): slots a request holds in each state group.
    Speculative decoding with ``k`` drafts needs ``1 + k``: slot 0 is the request's state,
    slots ``1 .. k`` hold the states after each draft position while the step verifies
    (docs/speculative-decoding.md, "State groups"); size ``num_state_slots`` for it.
    """

    num_blocks: int
    groups: tuple[KVCacheGroupSpec, ...]
    num_state_slots: int | None = None
    state_slots_per_request: int = 1

    def __post_init__(self):
        if self.num_blocks < 2:
            raise KVCacheSpecError(
                f"num_blocks must be >= 2 (block 0 is the reserved null block), got {self.num_blocks}")
        if self.num_state_slots is not None and self.num_state_slots < 2:
            raise KVCacheSpecError(
                f"num_state_slots must be >= 2 (slot 0 is the reserved null block), got {self.num_state_slots}")
        if not isinstance(self.state_slots_per_request, int) or self.state_slots_per_request < 1:
            raise KVCacheSpecError(f"state_slots_per_request must be an int >= 1, got {self.state_slots_per_request!r}")
        names = [n for g in self.groups for n in g.layer_names]
        if len(names) != len(set(names)):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise KVCacheSpecError(f"layers {dup} appear in more than one cache group")

    @property
    def block_sizes(self) -> list[int]:
        return [g.kv_cache_spec.block_size for g in self.groups]

    def num_blocks_of(self, group: int) -> int:
        """Blocks in group ``group``'s pool (``num_state_slots`` for a Mamba group when set)."""
        if self.num_state_slots is not None and self.groups[group].kv_cache_spec.kind is GroupKind.MAMBA:
            return self.num_state_slots
        return self.num_blocks


def group_layers_by_spec(layer_specs: Mapping[str, KVCacheSpec],
                         max_layers_per_group: int | None = None) -> tuple[KVCacheGroupSpec, ...]:
    """Group layers with equal specs, in order of first appearance.

    Args:
        layer_specs: ``{layer_name: spec}`` in model order.
        max_layers_per_group: split a spec's layers into groups of at most this many (vLLM
            splits hybrid models so every group has the same number of layers); ``None``
            keeps one group per distinct spec.

    Returns:
        The groups; layer order inside a group follows the model.

    Raises:
        KVCacheSpecError: an empty mapping, or a value that is not a ``KVCacheSpec``.
    """
    if not layer_specs:
        raise KVCacheSpecError("no layers to group: the model declared no KV-cache specs")
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        if not isinstance(spec, KVCacheSpec):
            raise KVCacheSpecError(f"layer {name!r}: {spec!r} is not a KVCacheSpec")
        by_spec.setdefault(spec, []).append(name)
    groups = []
    for spec, names in by_spec.items():
        step = max_layers_per_group or len(names)
        for i in range(0, len(names), step):
            groups.append(KVCacheGroupSpec(tuple(names[i:i + step]), spec))
    return tuple(groups)
