"""Per-step lowering of the common metadata by each cache group's builder, with caching.

Layers of a group share one metadata object. Groups with the same ``(kv_cache_spec,
builder class)`` build once per step; the others get
``builder.update_block_table(cached, block_table, slot_mapping)`` when the builder
supports it (``supports_update_block_table``), else their own ``build``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from attnplug.core.contracts import AttentionMetadataBuilder
from attnplug.core.metadata import CommonAttentionMetadata


@dataclass
class BuildCounters:
    """Builds and reuses of the latest step, and totals since creation."""

    builds: int = 0
    reuses: int = 0
    total_builds: int = 0
    total_reuses: int = 0
    steps: int = 0

    def start_step(self) -> None:
        self.builds = self.reuses = 0
        self.steps += 1


@dataclass
class GroupMetadataBuilder:
    """Runs the groups' builders once per step and maps every layer to its metadata.

    Args:
        builders: one builder per cache group, in group order.
        layer_names: per group, the layer names that read the group's metadata.
        enable_caching: reuse one build across groups with the same (spec, builder class).
    """

    builders: Sequence[AttentionMetadataBuilder]
    layer_names: Sequence[Sequence[str]]
    enable_caching: bool = True
    counters: BuildCounters = field(default_factory=BuildCounters)

    def build(self, common: Sequence[CommonAttentionMetadata],
              common_prefix_len: int | Sequence[int] = 0, *,
              for_cudagraph: bool = False) -> tuple[list[Any], dict[str, Any]]:
        """Build this step's metadata.

        Args:
            common: per group, the step's common metadata (group ``g``'s block table and
                slot mapping).
            common_prefix_len: forwarded to ``build``: one value for every group, or one
                per group (cascade attention, ``runner/execute/cascade.py``). A group built
                with a non-zero value is never reused for another group (its prefix pass
                reads its own block table's shared blocks).
            for_cudagraph: the step captures or replays a CUDA graph: builders run
                ``build_for_cudagraph_capture`` instead of ``build``.

        Returns:
            ``(per_group, per_layer)``: the metadata of each group, and ``{layer_name:
            metadata}`` where all layers of a group map to the same object.
        """
        self.counters.start_step()
        cache: dict[tuple[Any, type], Any] = {}
        per_group: list[Any] = []
        per_layer: dict[str, Any] = {}
        prefix_lens = ([common_prefix_len] * len(self.builders) if isinstance(common_prefix_len, int)
                       else list(common_prefix_len))
        for builder, names, cm, prefix in zip(self.builders, self.layer_names, common, prefix_lens):
            key = (builder.kv_cache_spec, type(builder))
            reuse = self.enable_caching and builder.supports_update_block_table and prefix == 0
            hit = cache.get(key) if reuse else None
            if hit is not None:
                md = builder.update_block_table(hit, cm.block_table_tensor, cm.slot_mapping)
                self.counters.reuses += 1
            else:
                md = (builder.build_for_cudagraph_capture(cm) if for_cudagraph
                      else builder.build(prefix, cm))
                if prefix == 0:
                    cache[key] = md
                self.counters.builds += 1
            per_group.append(md)
            for name in names:
                per_layer[name] = md
        self.counters.total_builds += self.counters.builds
        self.counters.total_reuses += self.counters.reuses
        return per_group, per_layer
