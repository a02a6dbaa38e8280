"""Cascade attention in ``torch_native``: a shared-prefix pass, a suffix pass, one merge.

With ``common_prefix_len = P > 0`` (every request's first ``P`` tokens are the same
physical blocks, ``P <= min(num_computed_tokens)``, full attention), the builder lowers
the step twice: once as ``TorchNativeCascade.prefix_block_ids`` (row 0's first ``P / B``
blocks, which every query sees whole: no mask), and once as the ordinary segments of a
*suffix* step whose block table starts at column ``P / B`` and whose ``seq_lens`` are
``seq_lens - P`` (causality is relative to the end of a request, so the suffix masks are
those of the full step). ``forward`` attends all queries to the prefix once, each request
to its suffix, and merges the two by log-sum-exp (``backends/common/merge.py``); the result
equals the one-pass attention up to float32 rounding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from attnplug.backends.common.merge import merge_attn_states
from attnplug.backends.common.sinks import fold_sinks
from attnplug.backends.torch_native.attention import gather_from_paged_cache, keys_used, visibility_mask
from attnplug.core.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class TorchNativeCascade:
    """The shared-prefix pass of a cascade step."""

    common_prefix_len: int
    """``P`` tokens, a multiple of the block size, ``<=`` every ``num_computed_tokens``."""
    prefix_block_ids: torch.Tensor
    """``[1, P // block_size]``, ``torch.int64``, device: the shared blocks."""


def build_cascade(builder, cm: CommonAttentionMetadata, common_prefix_len: int):
    """The cascade metadata of ``builder`` (a ``TorchNativeMetadataBuilder``) for ``cm``.

    ``common_prefix_len`` is clamped to the smallest ``num_computed_tokens`` and rounded
    down to the block size; when nothing is left, the ordinary build.
    """
    n, B = cm.num_reqs, builder.block_size
    prefix = min(int(common_prefix_len), int(cm.num_computed_tokens_cpu[:n].min())) // B * B
    if prefix <= 0:
        return builder.build(0, cm)
    nb = prefix // B
    suffix_cm = cm.replace(
        seq_lens=cm.seq_lens - prefix, seq_lens_cpu=cm.seq_lens_cpu - prefix,
        num_computed_tokens_cpu=cm.num_computed_tokens_cpu - prefix, max_seq_len=cm.max_seq_len - prefix,
        block_table_tensor=cm.block_table_tensor[:, nb:])
    md = builder.build(0, suffix_cm)
    cascade = TorchNativeCascade(prefix, cm.block_table_tensor[:1, :nb].long())
    return dataclasses.replace(md, cascade=cascade)


def attend_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
                    logits_soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention.attend`` that also returns the log-sum-exp of each query's logits.

    Args:
        query: ``[n, q, num_heads, head_size]``.
        key, value: ``[n, k, num_kv_heads, head_size]``.
        mask: ``[n, q, k]`` bool, True = visible; a row may be fully masked (its lse is
            ``-inf`` and its output 0).
        scale, logits_soft_cap: as ``attend``.

    Returns:
        ``(out, lse)``: ``[n, q, num_heads, head_size]`` float32 and ``[n, q, num_heads]``
        float32 (natural log).
    """
    n, q_len, H, D = query.shape
    Hkv = key.shape[2]
    group = H // Hkv
    q = (query.float() * scale).view(n, q_len, Hkv, group, D)
    k = key.float().unsqueeze(3).expand(n, key.shape[1], Hkv, group, D).reshape(n, key.shape[1], H, D)
    v = value.float().unsqueeze(3).expand(n, key.shape[1], Hkv, group, D).reshape(n, key.shape[1], H, D)
    logits = torch.einsum("nqhd,nkhd->nhqk", q.reshape(n, q_len, H, D), k)
    if logits_soft_cap is not None:
        logits = logits.div(logits_soft_cap).tanh().mul(logits_soft_cap)
    logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [n, H, q]
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.einsum("nhqk,nkhd->nqhd", probs, v)
    return out, lse.transpose(1, 2)


def cascade_forward(impl, query: torch.Tensor, kv_cache: torch.Tensor, md, output: torch.Tensor,
                    scales: tuple = (None, None)) -> torch.Tensor:
    """Attention of a cascade step (K/V already written): prefix pass, suffix pass, merge."""
    c: TorchNativeCascade = md.cascade
    T, P = md.num_actual_tokens, c.common_prefix_len
    dev = query.device
    used = torch.ones(1, P, dtype=torch.bool, device=dev)
    pk, pv = gather_from_paged_cache(kv_cache, c.prefix_block_ids, used, *scales)
    prefix_out, prefix_lse = attend_with_lse(query[:T].unsqueeze(0), pk, pv, used.unsqueeze(1).expand(1, T, P),
                                             impl.scale, impl.logits_soft_cap)
    suffix_out = torch.zeros(T, impl.num_heads, impl.head_size, dtype=torch.float32, device=dev)
    suffix_lse = torch.full((T, impl.num_heads), float("-inf"), dtype=torch.float32, device=dev)
    for seg in md.segments:
        num_keys = seg.key_block_ids.shape[1] * md.block_size
        used_s = keys_used(seg.seq_lens, seg.query_len, num_keys)
        keys, values = gather_from_paged_cache(kv_cache, seg.key_block_ids, used_s, *scales)
        mask = visibility_mask(seg.query_positions, seg.seq_lens, 0, num_keys, causal=md.causal)
        tokens = seg.query_token_indices
        out, lse = attend_with_lse(query[tokens], keys, values, mask, impl.scale, impl.logits_soft_cap)
        suffix_out[tokens.flatten()] = out.flatten(0, 1)
        suffix_lse[tokens.flatten()] = lse.flatten(0, 1)
    merged = merge_attn_states(suffix_out, suffix_lse.T, prefix_out[0], prefix_lse[0].T)
    if impl.sinks is not None:  # the sink joins the merged denominator once
        merged = fold_sinks(merged, torch.logaddexp(suffix_lse, prefix_lse[0]), impl._sinks_on(dev))
    output[:T] = merged.to(output.dtype)
    return output
