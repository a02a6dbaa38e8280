"""Cascade attention on the Triton backend: a prefix pass, a suffix pass, one merge.

With ``common_prefix_len = P > 0`` (every request's first ``P`` tokens are the same
physical blocks, ``P <= min(num_computed_tokens)``, full attention; the runner decides,
``runner/execute/cascade.py``), :func:`build_cascade` adds a
:class:`~attnplug.backends.triton.metadata.TritonCascadeMetadata` to the ordinary
metadata, and :func:`cascade_attention` runs the unified kernel twice with ``STORE_LSE``:

* **prefix pass**: one non-causal "request" whose queries are all ``T`` tokens of the
  step and whose ``P`` keys are the shared blocks (read once for the whole step);
* **suffix pass**: the step with ``seq_lens - P`` and the block table from column
  ``P / B`` on, causal (query ``j`` of request ``i`` sits at ``seq_len_i - P - q_i + j``
  there, so it sees exactly its own keys after the prefix);

then merges them by log-sum-exp (:func:`~attnplug.backends.common.merge.merge_attn_states`,
torch ops): with ``o1, l1`` the suffix pass's output and natural-log LSE, ``o2, l2`` the
prefix pass's and ``m = max(l1, l2)``,
``out = (o1 * exp(l1 - m) + o2 * exp(l2 - m)) / (exp(l1 - m) + exp(l2 - m))``; a part
with ``lse = -inf`` (no key seen) weighs 0. Both passes write fp32 outputs; the result
equals the one-pass attention up to fp32 rounding (and the cache dtype's ``P @ V``).

Both passes take the unified path (``num_kv_splits = 1``): the kernel stores the LSE
there only. Cascade steps are never CUDA-graph steps (the planner refuses padded steps).
"""

from __future__ import annotations

import dataclasses

import torch

from attnplug.backends.common.merge import merge_attn_states
from attnplug.backends.triton.attention import paged_attention
from attnplug.backends.triton.metadata import TritonAttentionMetadata, TritonCascadeMetadata
from attnplug.core.metadata import CommonAttentionMetadata


def cascade_prefix_len(cm: CommonAttentionMetadata, common_prefix_len: int, block_size: int) -> int:
    """``common_prefix_len`` clamped to the smallest ``num_computed_tokens`` of the step's
    requests and rounded down to ``block_size`` (0: no cascade). Host ints only."""
    n = cm.num_reqs
    if common_prefix_len <= 0 or n == 0:
        return 0
    return min(int(common_prefix_len), int(cm.num_computed_tokens_cpu[:n].min())) // block_size * block_size


def cascade_fields(md: TritonAttentionMetadata, prefix: int) -> TritonCascadeMetadata:
    """The prefix and suffix passes' tensors of ``md`` (whole-step metadata) for ``P = prefix``.

    Three small device kernels (fills for ``[0, T]`` and ``[P]``, ``seq_lens - P``), no
    host-to-device copy and no host synchronisation; the block tables are views of
    ``md.block_table_tensor``.
    """
    dev = md.seq_lens.device
    nb = prefix // md.block_size
    prefix_qsl = torch.zeros((2,), dtype=torch.int32, device=dev)
    prefix_qsl[1:].fill_(md.num_actual_tokens)  # a fill kernel: ``qsl[0] = 0`` would copy a host scalar
    return TritonCascadeMetadata(
        common_prefix_len=prefix,
        prefix_query_start_loc=prefix_qsl,
        prefix_seq_lens=torch.full((1,), prefix, dtype=torch.int32, device=dev),
        prefix_block_table=md.block_table_tensor[:1, :nb],
        suffix_seq_lens=md.seq_lens - prefix,
        suffix_block_table=md.block_table_tensor[:, nb:])


def with_cascade(md: TritonAttentionMetadata, cm: CommonAttentionMetadata, common_prefix_len: int,
                 sliding_window: int | None) -> TritonAttentionMetadata:
    """``md`` with its cascade fields, or ``md`` itself when no cascade applies (a window,
    a CUDA-graph build, or nothing left after :func:`cascade_prefix_len`)."""
    if sliding_window is not None or md.graph:
        return md
    prefix = cascade_prefix_len(cm, common_prefix_len, md.block_size)
    return md if prefix <= 0 else dataclasses.replace(md, cascade=cascade_fields(md, prefix))


def cascade_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      output: torch.Tensor, md: TritonAttentionMetadata, *, scale: float,
                      logits_soft_cap: float | None, sinks: torch.Tensor | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a cascade step (K/V already written): prefix pass, suffix pass, merge.
    ``k_scale`` / ``v_scale``: an fp8 cache's descales, as :func:`paged_attention` takes them.

    Args:
        query: ``[num_tokens, num_heads, head_size]``; rows past ``md.num_actual_tokens``
            are padding (left untouched in ``output``).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        output: like ``query``; its first ``md.num_actual_tokens`` rows are overwritten.
        md: metadata with ``md.cascade`` set (full attention).
        scale, logits_soft_cap: the layer's.
        sinks: the layer's ``[num_heads]`` float32 sink logits or ``None``; they enter the
            prefix pass only (its LSE then includes them), so the merge counts them once.

    Returns:
        ``output``.
    """
    c = md.cascade
    T, H = md.num_actual_tokens, query.shape[1]
    q = query[:T]
    dev = query.device
    prefix_out = torch.empty(T, H, query.shape[2], dtype=torch.float32, device=dev)
    suffix_out = torch.empty_like(prefix_out)
    prefix_lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    suffix_lse = torch.empty_like(prefix_lse)
    common = dict(scale=scale, logits_soft_cap=logits_soft_cap, num_kv_splits=1, check_values=False,
                  k_scale=k_scale, v_scale=v_scale)
    paged_attention(q, key_cache, value_cache, prefix_out, c.prefix_query_start_loc, c.prefix_seq_lens,
                    c.prefix_block_table, num_reqs=1, max_query_len=T, causal=False, lse=prefix_lse, sinks=sinks,
                    **common)
    paged_attention(q, key_cache, value_cache, suffix_out, md.query_start_loc, c.suffix_seq_lens,
                    c.suffix_block_table, num_reqs=md.num_reqs, max_query_len=md.max_query_len, causal=md.causal,
                    lse=suffix_lse, **common)
    output[:T] = merge_attn_states(suffix_out, suffix_lse.T, prefix_out, prefix_lse.T).to(output.dtype)
    return output
