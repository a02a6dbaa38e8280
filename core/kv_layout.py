"""A backend's KV cache layout, declared once: the order of one layer's cache dimensions and
where an fp8 cache's scales live.

``AttentionBackend.kv_cache_layout`` holds a :class:`KVCacheLayout`; the base class derives
``get_kv_cache_shape`` and ``split_kv_cache`` from it, so a backend whose cache is a
permutation of the five dimensions below declares the order and writes neither method.
(A backend with another packing, e.g. vLLM CPU_ATTN's per-block transposed K, still
overrides ``split_kv_cache``: ``plugins/vllm/reverse.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DIMS: tuple[str, ...] = ("block", "kv", "token", "head", "dim")
"""``block``: kernel block id; ``kv``: 0 = K, 1 = V; ``token``: offset in the block;
``head``: KV head; ``dim``: element of the head."""

SCALE_PLACES: tuple[str, ...] = ("layer",)
"""Where fp8 scales live: ``layer`` = float32 ``k_scale`` / ``v_scale`` attributes of the
layer module, ``[]`` or ``[num_kv_heads]`` (``core/kv_quant.py``)."""


@dataclass(frozen=True)
class KVCacheLayout:
    """The cache of one layer as a permutation of :data:`DIMS`.

    Attributes:
        dims: the tensor's dimensions, outermost first. The default is vLLM's and FlashInfer's
            NHD with K/V inside the block: ``[num_blocks, 2, block_size, num_kv_heads,
            head_size]``; FlashAttention's is ``("kv", "block", "token", "head", "dim")``;
            HND is ``("block", "kv", "head", "token", "dim")``.
        scales: where an fp8 cache's ``k_scale`` / ``v_scale`` live (:data:`SCALE_PLACES`).

    Raises:
        ValueError: ``dims`` not a permutation of :data:`DIMS`, or an unknown ``scales``.

    Examples:
        >>> KVCacheLayout().shape(8, 16, 2, 64)
        (8, 2, 16, 2, 64)
        >>> KVCacheLayout(dims=("kv", "block", "token", "head", "dim")).shape(8, 16, 2, 64)
        (2, 8, 16, 2, 64)
    """

    dims: tuple[str, ...] = DIMS
    scales: str = "layer"

    def __post_init__(self):
        if sorted(self.dims) != sorted(DIMS) or len(self.dims) != len(DIMS):
            raise ValueError(f"KVCacheLayout dims {self.dims!r} must be a permutation of {DIMS}")
        if self.scales not in SCALE_PLACES:
            raise ValueError(f"KVCacheLayout scales {self.scales!r} must be one of {SCALE_PLACES}")

    def shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The cache tensor's shape (kernel blocks, tokens per kernel block, KV heads, elements)."""
        size = {"block": num_blocks, "kv": 2, "token": block_size, "head": num_kv_heads, "dim": head_size}
        return tuple(size[d] for d in self.dims)

    def split(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_kv_heads,
        head_size]``: views of ``kv_cache`` (a permute and a select, sharing storage)."""
        order = [self.dims.index(d) for d in ("kv", "block", "token", "head", "dim")]
        nhd = kv_cache.permute(*order)
        return nhd[0], nhd[1]
