"""``MLACommonMetadataBuilder``: decodes first, prefills after, and the context chunk plan.

Once per step per MLA cache group it lowers the
:class:`~attnplug.core.metadata.CommonAttentionMetadata` into an
:class:`~attnplug.core.mla.MLAMetadata`:

* **the split**: the leading rows whose query is at most ``reorder_batch_threshold`` (1)
  tokens are decodes (the runner puts them first because the builder declares the
  threshold); every row from the first longer query on is a prefill (a short row after a
  long one is served as a prefill too, which is correct, only slower).
* **decode sub-metadata**: their block-table rows and ``seq_lens``; a backend adds its
  kernel's plan by overriding :meth:`MLACommonMetadataBuilder.build_decode`.
* **prefill sub-metadata**: the prefills' ``query_start_loc`` (from their first token) and
  the chunk plan of their cached context (:func:`plan_context_chunks`): each chunk holds at
  most ``workspace_tokens`` latent rows, so the impl's workspace stays bounded whatever
  the context length.

The builder keeps no per-step state: every build returns a fresh object, so N builds
followed by N forwards equal N (build, forward) pairs (vllm#50945 found MLA builders that
did not).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attnplug.cache_groups.buffers import upload
from attnplug.cache_groups.specs import cdiv
from attnplug.core.contracts import AttentionCGSupport, AttentionMetadataBuilder, BuilderConfig
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.mla import MLAContextChunk, MLADecodeMetadata, MLAMetadata, MLAPrefillMetadata

MAX_WORKSPACE_TOKENS = 64 * 1024
"""Cap of the default workspace (latent rows; 64 Ki x 576 x 2 bytes = 72 MiB in bf16)."""


def default_workspace_tokens(config: BuilderConfig, block_size: int) -> int:
    """``min(max(8 * max_model_len, 4 * max_num_reqs * block_size), 64 Ki)`` rows, and at
    least ``max_num_reqs`` (one token per prefill per chunk)."""
    want = max(8 * config.max_model_len, 4 * config.max_num_reqs * block_size)
    return max(min(want, MAX_WORKSPACE_TOKENS), config.max_num_reqs)


def plan_context_chunks(context_lens: np.ndarray, workspace_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split the prefills' cached context into chunks of at most ``workspace_tokens`` rows.

    Every chunk gives each request the same span ``chunk_len = workspace_tokens //
    num_prefills`` of its context (fewer where its context ends), so a chunk's rows never
    exceed the workspace and ``cdiv(max(context_lens), chunk_len)`` chunks cover all.

    Args:
        context_lens: ``[num_prefills]`` ints >= 0 (tokens cached before this step).
        workspace_tokens: rows of the workspace (``>= num_prefills``).

    Returns:
        Per chunk ``(starts, lens)``, each ``[num_prefills]`` int64: request ``r`` reads its
        context tokens ``starts[r] .. starts[r] + lens[r] - 1``. Empty when no context.

    Raises:
        MetadataError: ``workspace_tokens < num_prefills``.

    Examples:
        >>> [(s.tolist(), n.tolist()) for s, n in plan_context_chunks(np.array([5, 2]), 4)]
        [([0, 0], [2, 2]), ([2, 2], [2, 0]), ([4, 4], [1, 0])]
    """
    n = len(context_lens)
    if n == 0 or int(context_lens.max(initial=0)) == 0:
        return []
    if workspace_tokens < n:
        raise MetadataError(f"MLA workspace of {workspace_tokens} rows cannot hold one context token of each of "
                            f"{n} prefills: give the builder workspace_tokens >= max_num_reqs")
    chunk_len = workspace_tokens // n
    ctx = context_lens.astype(np.int64)
    chunks = []
    for c in range(cdiv(int(ctx.max()), chunk_len)):
        starts = np.full(n, c * chunk_len, dtype=np.int64)
        lens = np.clip(ctx - starts, 0, chunk_len)
        chunks.append((starts, lens))
    return chunks


class MLACommonMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`~attnplug.core.mla.MLAMetadata` for an MLA cache group.

    ``Builder(kv_cache_spec, layer_names, config, device, *, workspace_tokens=None)``:
    ``workspace_tokens`` bounds the rows of cached context a prefill gathers at once
    (default :func:`default_workspace_tokens`; the conformance suite passes a tiny one).

    Raises (constructor):
        MetadataError: ``workspace_tokens < config.max_num_reqs``.
    """

    cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = 1

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], config: BuilderConfig,
                 device: torch.device | str, *, workspace_tokens: int | None = None):
        super().__init__(kv_cache_spec, layer_names, config, device)
        ws = default_workspace_tokens(config, kv_cache_spec.block_size) if workspace_tokens is None \
            else workspace_tokens
        if not isinstance(ws, int) or ws < config.max_num_reqs or ws <= 0:
            raise MetadataError(f"MLA workspace_tokens must be an int >= max_num_reqs {config.max_num_reqs}, "
                                f"got {ws!r}")
        self.workspace_tokens = ws

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MLAMetadata:
        """The step's :class:`MLAMetadata` (``common_prefix_len`` is ignored: no cascade).

        Raises:
            MetadataError: a block table whose block size disagrees with the spec.
        """
        cm = common_attn_metadata
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: n + 1].numpy().astype(np.int64)
        qlens = np.diff(qsl)
        long = np.nonzero(qlens > self.reorder_batch_threshold)[0]
        num_decodes = int(long[0]) if len(long) else n
        num_decode_tokens = int(qsl[num_decodes])
        decode = self.build_decode(cm, num_decodes) if num_decodes else None
        prefill = self.build_prefill(cm, num_decodes, qsl, qlens) if num_decodes < n else None
        return MLAMetadata(num_reqs=n, num_actual_tokens=cm.num_actual_tokens, num_decodes=num_decodes,
                           num_decode_tokens=num_decode_tokens, num_prefills=n - num_decodes,
                           block_size=self.kv_cache_spec.block_size, slot_mapping=cm.slot_mapping,
                           decode=decode, prefill=prefill)

    def build_decode(self, cm: CommonAttentionMetadata, num_decodes: int) -> MLADecodeMetadata:
        """The decode sub-metadata of rows ``0 .. num_decodes - 1`` (override to add a plan)."""
        seq = cm.seq_lens_cpu[:num_decodes]
        return MLADecodeMetadata(num_decodes=num_decodes, block_table=cm.block_table_tensor[:num_decodes],
                                 seq_lens=cm.seq_lens[:num_decodes], max_seq_len=int(seq.max()))

    def build_prefill(self, cm: CommonAttentionMetadata, first: int, qsl: np.ndarray,
                      qlens: np.ndarray) -> MLAPrefillMetadata:
        """The prefill sub-metadata of rows ``first .. num_reqs - 1`` and their chunk plan."""
        n = cm.num_reqs
        rel = torch.from_numpy((qsl[first:] - qsl[first]).astype(np.int32))
        ctx = (cm.seq_lens_cpu[first:n].numpy().astype(np.int64) - qlens[first:])
        chunks = tuple(self._chunk(cm.block_table_tensor[first:n], starts, lens)
                       for starts, lens in plan_context_chunks(ctx, self.workspace_tokens))
        return MLAPrefillMetadata(num_prefills=n - first, query_start_loc=rel.to(self.device),
                                  max_query_len=int(qlens[first:].max()),
                                  context_lens=torch.from_numpy(ctx.astype(np.int32)), chunks=chunks,
                                  workspace_tokens=max((c.total_tokens for c in chunks), default=0))

    def _chunk(self, block_table: torch.Tensor, starts: np.ndarray, lens: np.ndarray) -> MLAContextChunk:
        """One chunk: the slots of each request's span, from its block-table row (device)."""
        bs = self.kv_cache_spec.block_size
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        cu[1:] = np.cumsum(lens)
        total = int(cu[-1])
        req = np.repeat(np.arange(len(lens)), lens)
        pos = starts[req] + np.arange(total) - cu[:-1][req]
        req_t, pos_t = upload(np.stack([req, pos]).astype(np.int64, copy=False), self.device)  # one copy
        blocks = block_table[req_t, torch.div(pos_t, bs, rounding_mode="floor")].to(torch.int64)
        return MLAContextChunk(cu_seq_lens=upload(cu.astype(np.int32), self.device),
                               slots=blocks * bs + pos_t % bs, max_seq_len=int(lens.max()), total_tokens=total)
