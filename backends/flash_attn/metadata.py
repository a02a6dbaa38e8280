"""``FlashAttnMetadata``: one step of one cache group in the arguments FlashAttention takes.

``B`` below is the batch the kernel sees: ``query_start_loc.shape[0] - 1`` of the common
metadata, i.e. ``num_reqs`` plus any padded requests (CUDA graphs), which have empty
queries and zero keys. Every tensor is on the compute device: in an eager build the
step's own tensors (views of the step compiler's persistent buffers when the runner made
them, valid until its next ``update_states``), in a CUDA-graph build (``graph``) views of
the builder's persistent buffers (same address every step; contents valid until that
builder's next graph build or ``update_block_table``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlashAttnCascadeMetadata:
    """Cascade attention: every request shares its first ``common_prefix_len`` tokens.

    The impl attends all queries to the shared prefix once (one non-causal "sequence"),
    each request to its own suffix (causal), and merges the two by log-sum-exp.
    """

    common_prefix_len: int
    """Shared prefix in tokens: a multiple of ``block_size``, ``<=`` every request's
    ``num_computed_tokens`` (so every query sees the whole prefix)."""
    cu_prefix_query_lens: torch.Tensor
    """``[2]``, ``torch.int32``: ``[0, num_actual_tokens]`` (all queries as one sequence)."""
    prefix_kv_lens: torch.Tensor
    """``[1]``, ``torch.int32``: ``[common_prefix_len]`` (FA3 ``cache_seqlens``)."""
    cu_prefix_kv_lens: torch.Tensor
    """``[2]``, ``torch.int32``: ``[0, common_prefix_len]`` (FA2 ``cu_seqlens_k``)."""
    prefix_block_table: torch.Tensor
    """``[1, common_prefix_len // block_size]``, ``torch.int32``: the shared blocks."""
    suffix_kv_lens: torch.Tensor
    """``[B]``, ``torch.int32``: ``seq_lens - common_prefix_len`` (0 for padded requests)."""
    cu_suffix_kv_lens: torch.Tensor
    """``[B + 1]``, ``torch.int32``: exclusive prefix sum of ``suffix_kv_lens``."""
    suffix_block_table: torch.Tensor
    """``[B, max_num_blocks_per_req - num_prefix_blocks]``, ``torch.int32``: each row's
    blocks after the prefix (a view of the block table)."""
    max_suffix_kv_len: int
    """Longest suffix (tokens)."""


@dataclass(frozen=True)
class FlashAttnMetadata:
    """What every ``flash_attn`` layer of a cache group reads in one step."""

    num_reqs: int
    """Real (non-padded) requests."""
    num_actual_tokens: int
    """Real (non-padded) tokens."""
    max_query_len: int
    """``max_seqlen_q``: an upper bound of every query length (tokens)."""
    max_seq_len: int
    """``max_seqlen_k``: an upper bound of every ``seq_lens`` entry (tokens)."""
    block_size: int
    """Tokens per kernel block (``page_block_size``)."""
    causal: bool
    """Bottom-right aligned causal mask (query ``j`` of a request with ``Lq`` queries and
    ``Lk`` keys sees keys up to ``j + Lk - Lq``)."""
    query_start_loc: torch.Tensor
    """``cu_seqlens_q``: ``[B + 1]``, ``torch.int32``; tokens. Padded requests repeat the
    last value (empty queries)."""
    seq_lens: torch.Tensor
    """``seqused_k`` / FA3 ``cache_seqlens``: ``[B]``, ``torch.int32``; keys per request
    (0 for padded requests)."""
    cu_seqlens_k: torch.Tensor | None
    """``[B + 1]``, ``torch.int32``: exclusive prefix sum of ``seq_lens`` (FA2's paged varlen
    call takes key lengths this way); ``None`` under FlashAttention 3, which does not read it."""
    block_table: torch.Tensor
    """``block_table`` / FA3 ``page_table``: ``[B, width]``, ``torch.int32`` (``width``: the
    step's table in an eager build, ``max_num_blocks_per_req`` in a graph build); kernel
    block ids in logical order. Columns past a request's ``cdiv(seq_len, block_size)`` are
    never read (``NULL_BLOCK_ID``, or in a graph build what an earlier step left)."""
    slot_mapping: torch.Tensor
    """``[num_tokens]`` (padded length), ``torch.int64``; ``PAD_SLOT_ID`` = not written."""
    window_size: tuple[int, int]
    """FlashAttention ``window_size=(left, right)``, inclusive: ``(W - 1, 0)`` for a
    ``W``-token window, ``(-1, -1)`` without (``attnplug.backends.common.window``)."""
    scheduler_metadata: torch.Tensor | None = None
    """FA3 ``get_scheduler_metadata`` output (int32) for the step's shapes, or ``None``
    (FA2, or no layer parameters known): the kernel then schedules by itself."""
    cascade: FlashAttnCascadeMetadata | None = None
    """Set when the step is run as cascade attention (``common_prefix_len > 0``)."""
    graph: bool = False
    """Built by ``build_for_cudagraph_capture``: every tensor is in the builder's persistent
    buffers (``update_block_table`` then copies the other group's tensors there too)."""

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        """FlashAttention's name for :attr:`query_start_loc`."""
        return self.query_start_loc

    @property
    def seqused_k(self) -> torch.Tensor:
        """FlashAttention's name for :attr:`seq_lens`."""
        return self.seq_lens

    @property
    def max_seqlen_q(self) -> int:
        return self.max_query_len

    @property
    def max_seqlen_k(self) -> int:
        return self.max_seq_len

    @property
    def batch_size(self) -> int:
        """``B``: requests the kernel sees (real + padded)."""
        return int(self.query_start_loc.shape[0]) - 1
