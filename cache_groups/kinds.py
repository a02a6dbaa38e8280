"""``GroupKind``: the kind of a KV-cache group, defined once for the whole package.

A group's kind decides how the step compiler treats its block table and which backends
may serve it (``attnplug.plugins.config`` reads the same enum for its ``[backends]``
keys). It is a ``str`` enum, so ``GroupKind.MAMBA == "mamba"`` holds and config files,
JSON and messages keep the plain names.
"""

from __future__ import annotations

import enum


class GroupKind(str, enum.Enum):
    """Kind of a cache group (the ``kind`` of its :class:`~attnplug.cache_groups.specs.KVCacheSpec`).

    * ``FULL_ATTENTION``: every token's K/V stays in the group's blocks.
    * ``SLIDING_WINDOW``: blocks no query can see any more are freed; the null block
      (``NULL_BLOCK_ID``) may stand in a request's block list where they were.
    * ``MAMBA``: one state slot per request (its "block"); no paged K/V, no slot mapping.
    * ``MLA``: multi-head latent attention: full attention whose blocks hold one latent row
      per token (``kv_lora_rank + qk_rope_head_dim`` values, docs/mla.md) instead of K and V;
      blocks, block tables, slots and prefix caching as ``FULL_ATTENTION``.
    * ``INDEXER``: a sparse-attention indexer's keys (DeepSeek-V3.2: one ``index_head_dim``
      row per token, docs/mla.md "The sparse path"), the sibling of an ``MLA`` group; blocks,
      block tables, slots and prefix caching as ``FULL_ATTENTION``.
    """

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"
    MLA = "mla"
    INDEXER = "indexer"

    # plain names in f-strings, str() and format() on every Python version
    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def parse(cls, value: object) -> "GroupKind":
        """``value`` (a member or its name) as a member.

        Raises:
            ValueError: not one of the names.
        """
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown cache-group kind {value!r}: expected one of "
                             f"{', '.join(k.value for k in cls)}") from None


PAGED_FULL_KINDS: frozenset[GroupKind] = frozenset({GroupKind.FULL_ATTENTION, GroupKind.MLA,
                                                          GroupKind.INDEXER})
"""Kinds whose blocks hold every token of a request (no window, no state slot): the step
compiler's full-attention invariants and the block pool's full-attention policy apply."""

GROUP_KIND_NAMES: tuple[str, ...] = tuple(k.value for k in GroupKind)
"""The kinds' names in definition order."""
