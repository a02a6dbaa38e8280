"""Cache groups: KV-cache specs, grouping layers into groups, block tables, slot mapping.

A cache group is a set of layers with equal :class:`KVCacheSpec`; its requests' blocks
live in one pool and one block table. Row operations on a :class:`MultiGroupBlockTable`
apply to every group (a row is one request in all of them).
"""

from attnplug.cache_groups.block_table import BlockTable, MultiGroupBlockTable, expand_to_kernel_block_ids
from attnplug.cache_groups.buffers import CpuGpuBuffer
from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec, group_layers_by_spec
from attnplug.cache_groups.ragged import cumsum_and_arange, repeat_indices
from attnplug.cache_groups.specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    StateSpec,
    StateTensorSpec,
    cdiv,
)

__all__ = [
    "AttentionSpec", "BlockTable", "CpuGpuBuffer", "FullAttentionSpec", "KVCacheConfig", "KVCacheGroupSpec",
    "KVCacheSpec", "MLAAttentionSpec", "MambaSpec", "MultiGroupBlockTable", "SlidingWindowSpec", "StateSpec", "StateTensorSpec", "cdiv", "cumsum_and_arange",
    "expand_to_kernel_block_ids", "group_layers_by_spec", "repeat_indices",
]
