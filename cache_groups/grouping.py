"""Cache groups: layers with equal specs share one block table and one block pool.

``group_layers_by_spec`` turns a model's ``{layer_name: spec}`` into ordered
:class:`KVCacheGroupSpec` s (vLLM's ``KVCacheGroupSpec``); ``KVCacheConfig`` adds the
block count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from attnplug.cache_groups.specs import KVCacheSpec
from attnplug.core.errors import KVCacheSpecError


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """A cache group: the layers (in model order) that share ``kv_cache_spec``."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The whole model's cache: ``num_blocks`` per group's pool, and the groups."""

    num_blocks: int
    groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self):
        if self.num_blocks < 2:
            raise KVCacheSpecError(
                f"num_blocks must be >= 2 (block 0 is the reserved null block), got {self.num_blocks}")
        names = [n for g in self.groups for n in g.layer_names]
        if len(names) != len(set(names)):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise KVCacheSpecError(f"layers {dup} appear in more than one cache group")

    @property
    def block_sizes(self) -> list[int]:
        return [g.kv_cache_spec.block_size for g in self.groups]


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
