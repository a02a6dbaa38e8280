"""``GDNMetadata`` and its builder: the Mamba2 builder's split and slots, chunks per sequence.

A GDN group's step needs what a Mamba2 group's does (decodes first, one state slot per
row, ``has_initial_state``, the slots to zero, the varlen conv layout, a chunk layout of
the prefill part; ``backends.mamba2.metadata``), with one difference: chunks start at
each sequence's first scheduled token (flash-linear-attention's varlen convention), not
at absolute multiples of ``chunk_size``. The builder adds, on the host, the chunk tables
flash-linear-attention's varlen kernels take (``prepare_chunk_indices`` /
``prepare_chunk_offsets`` in its ``fla.ops.utils.index``)::

    query lens [5, 2], chunk_size 4  ->  chunk_indices [[0, 0], [0, 1], [1, 0]]
                                         chunk_offsets [0, 2, 3]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from attnplug.backends.mamba2.metadata import Mamba2Metadata, Mamba2MetadataBuilder
from attnplug.core.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class GDNMetadata(Mamba2Metadata):
    """:class:`~attnplug.backends.mamba2.metadata.Mamba2Metadata` (chunks from each
    sequence's start) plus the flash-linear-attention chunk tables of the prefill part."""

    chunk_indices: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 2), np.int64))
    """``[num_chunks, 2]``, ``int64`` CPU numpy: ``(prefill sequence, chunk within it)`` per chunk."""
    chunk_offsets: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(1, np.int64))
    """``[num_prefills + 1]``, ``int64`` CPU numpy: first chunk of each prefill sequence (last:
    ``num_chunks``)."""


_NO_CHUNKS = np.zeros((0, 2), dtype=np.int64)
_NO_OFFSETS = np.zeros(1, dtype=np.int64)


def fla_chunk_tables(chunk_seq_idx: np.ndarray, num_prefills: int) -> tuple[np.ndarray, np.ndarray]:
    """``(chunk_indices [K, 2], chunk_offsets [P + 1])`` from each chunk's sequence
    (``chunk_seq_idx`` ``[K]``, non-decreasing), all ``int64`` host numpy.

    Examples:
        >>> ci, co = fla_chunk_tables(np.array([0, 0, 1]), 2)
        >>> ci.tolist(), co.tolist()
        ([[0, 0], [0, 1], [1, 0]], [0, 2, 3])
    """
    counts = np.bincount(chunk_seq_idx, minlength=num_prefills)[:num_prefills]
    offsets = np.zeros(num_prefills + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    within = np.arange(chunk_seq_idx.shape[0], dtype=np.int64) - offsets[chunk_seq_idx]
    return np.stack([chunk_seq_idx.astype(np.int64), within], axis=1), offsets


class GDNMetadataBuilder(Mamba2MetadataBuilder):
    """Builds :class:`GDNMetadata` for one GDN state group.

    Args:
        kv_cache_spec: the group's :class:`~attnplug.cache_groups.specs.StateSpec`
            (``state_kind = "gdn"``, ``chunk_size``, a ``conv_state`` tensor
            ``[conv_dim, conv_kernel_size - 1]``).
        layer_names, config, device: as every builder.

    Raises:
        KVCacheSpecError: a spec without ``chunk_size`` or a ``conv_state`` tensor.
    """

    chunks_from_sequence_start = True

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> GDNMetadata:
        """The Mamba2 builder's metadata plus :func:`fla_chunk_tables` (host numpy only: no
        device synchronisation, no extra upload).

        Raises:
            MetadataError: as :meth:`Mamba2MetadataBuilder.build`.
        """
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if md.num_prefills:
            ci, co = fla_chunk_tables(md.chunk_seq_idx, md.num_prefills)
        else:
            ci, co = _NO_CHUNKS, _NO_OFFSETS
        out = object.__new__(GDNMetadata)       # the fields of md as they are (a frozen dataclass: no
        out.__dict__.update(md.__dict__)        # per-field constructor on every decode step)
        out.__dict__.update(chunk_indices=ci, chunk_offsets=co)
        return out
