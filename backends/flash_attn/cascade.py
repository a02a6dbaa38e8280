"""Cascade attention's fields for the flash_attn builder (``FlashAttnCascadeMetadata``).

A cascade step runs the shared prefix once for all queries (one non-causal "request":
every token of the step against the first ``P`` keys) and each request's suffix on its
own, then merges the two (``backends/flash_attn/impl.py``). ``P`` is the runner's
``common_prefix_len`` rounded down to whole blocks and to the smallest
``num_computed_tokens`` (the tokens every request already has in the cache).
"""

from __future__ import annotations

import numpy as np
import torch

from attnplug.backends.flash_attn.metadata import FlashAttnCascadeMetadata, FlashAttnMetadata
from attnplug.cache_groups.buffers import upload
from attnplug.core.metadata import CommonAttentionMetadata


def cascade_for(md: FlashAttnMetadata, cm: CommonAttentionMetadata, common_prefix_len: int,
                sliding_window: int | None, device: torch.device) -> FlashAttnCascadeMetadata | None:
    """The cascade fields of ``md`` for ``common_prefix_len`` shared tokens, or ``None`` (no
    request, a sliding window, or nothing left after rounding to ``md.block_size``)."""
    n = cm.num_reqs
    if common_prefix_len <= 0 or n == 0 or sliding_window is not None:
        return None
    prefix = min(int(common_prefix_len), int(cm.num_computed_tokens_cpu[:n].min()))
    prefix = prefix // md.block_size * md.block_size
    return cascade_fields(md, prefix, device) if prefix > 0 else None


def cascade_fields(md: FlashAttnMetadata, prefix: int, device: torch.device) -> FlashAttnCascadeMetadata:
    """The cascade fields for a prefix of ``prefix`` tokens (a positive multiple of
    ``md.block_size``), on ``device``: three views of one small host-made tensor (one
    copy), the suffix lengths and their prefix sum (two device ops), views of
    ``md.block_table``."""
    B = md.batch_size
    num_prefix_blocks = prefix // md.block_size
    suffix = (md.seq_lens - prefix).clamp_(min=0)
    cu_suffix = torch.zeros(B + 1, dtype=torch.int32, device=device)
    torch.cumsum(suffix, 0, dtype=torch.int32, out=cu_suffix[1:])
    small = upload(np.array([0, md.num_actual_tokens, prefix, 0, prefix], dtype=np.int32), device)  # one copy
    return FlashAttnCascadeMetadata(
        common_prefix_len=prefix,
        cu_prefix_query_lens=small[0:2],
        prefix_kv_lens=small[2:3],
        cu_prefix_kv_lens=small[3:5],
        prefix_block_table=md.block_table[:1, :num_prefix_blocks],
        suffix_kv_lens=suffix, cu_suffix_kv_lens=cu_suffix,
        suffix_block_table=md.block_table[:, num_prefix_blocks:],
        max_suffix_kv_len=max(0, md.max_seq_len - prefix))
