"""Running one sparse case on a backend, and the float64 references it is judged by.

Caches start as NaN everywhere (the null block, unused blocks, the tail of each request's
last block); only the context rows of the case's requests are written. A selector that
scores a row no query may see, or a consumer that reads a row outside the selection, gets
NaN in its result. References (``core/sparse.py`` has the contract):

* selector: per query, ``sum_h w_h relu(scale q_h . k)`` over its request's keys ``0 ..
  position`` in float64, ordered by descending score, ties to the lower position;
* consumer: dense expanded MLA (``mla_harness.reference_output``'s form) over the request's
  keys with every key outside the query's selection masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from attnplug.cache_groups.indexer_spec import IndexerSpec
from attnplug.cache_groups.specs import MLAAttentionSpec, cdiv
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import BuilderConfig
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.sparse import IndexerLayerConfig, SparseMLALayerConfig
from attnplug.plugins.conformance.sparse_cases import SelectorCase, SparseMLACase

OUTPUT_SENTINEL = 7.0
"""What every consumer output row holds before ``forward``; padded rows must keep it."""


def block_layout(computed, scheduled, block_size: int, g: torch.Generator) -> tuple[np.ndarray, int, list[int]]:
    """``(block_table [num_reqs, max_blocks], num_blocks, seq_lens)``: shuffled distinct blocks >= 1."""
    seq = [c + s for c, s in zip(computed, scheduled)]
    need = [cdiv(s, block_size) for s in seq]
    num_blocks = sum(need) + 4
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    bt = np.zeros((len(seq), max(max(need), 1) + 1), dtype=np.int64)
    for i, k in enumerate(need):
        bt[i, :k] = [perm.pop() for _ in range(k)]
    return bt, num_blocks, seq


def common_metadata(case, block_table: np.ndarray, device: str) -> CommonAttentionMetadata:
    cm = CommonAttentionMetadata.from_lengths(list(case.num_computed_tokens), list(case.num_scheduled_tokens),
                                              block_table.tolist(), case.block_size, device=device)
    if case.num_padded_tokens:
        pad = torch.full((case.num_padded_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        cm = cm.replace(slot_mapping=torch.cat([cm.slot_mapping, pad]),
                        positions=torch.cat([cm.positions, torch.zeros_like(pad)]))
    return cm


def poisoned_cache(case, rows_per_req: list[torch.Tensor], block_table: np.ndarray, num_blocks: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """NaN everywhere but each request's context rows (positions ``< num_computed_tokens``)."""
    width = rows_per_req[0].shape[1]
    cache = torch.full((num_blocks, case.block_size, width), float("nan"), dtype=dtype)
    for i, ctx in enumerate(case.num_computed_tokens):
        for pos in range(ctx):
            cache[block_table[i, pos // case.block_size], pos % case.block_size] = rows_per_req[i][pos].to(dtype)
    return cache


def query_positions(case) -> list[tuple[int, int]]:
    """``(request, position)`` of every real query token, in stream order."""
    return [(i, ctx + j) for i, (ctx, q) in enumerate(zip(case.num_computed_tokens, case.num_scheduled_tokens))
            for j in range(q)]


def builder_config(case) -> BuilderConfig:
    seq = [a + b for a, b in zip(case.num_computed_tokens, case.num_scheduled_tokens)]
    return BuilderConfig(max_num_reqs=max(case.num_reqs, 1),
                         max_num_batched_tokens=max(1, sum(case.num_scheduled_tokens)), max_model_len=max(seq) + 1)


# --- the selector -----------------------------------------------------------------------------
@dataclass
class SelectorRun:
    case: SelectorCase
    indices: torch.Tensor
    """``[num_tokens + num_padded_tokens, index_topk]`` int32 as returned."""
    cache_before: torch.Tensor
    cache_after: torch.Tensor
    slot_mapping: torch.Tensor
    new_rows: torch.Tensor
    """``[num_tokens, index_head_dim]``: what each new token's slot must hold."""


class SelectorStep:
    """One selector case prepared for a backend (float64 masters on the CPU)."""

    def __init__(self, backend_cls, case: SelectorCase, device: str, seed: int = 0):
        self.backend_cls, self.case, self.device = backend_cls, case, device
        self.dtype = getattr(torch, case.dtype)
        g = torch.Generator().manual_seed(seed)
        self.block_table, self.num_blocks, seq = block_layout(case.num_computed_tokens, case.num_scheduled_tokens,
                                                              case.block_size, g)
        d, t, h = case.index_head_dim, sum(case.num_scheduled_tokens), case.index_n_heads
        if case.ties:  # small integers: every score exact in any float dtype, so ties are exact
            self.keys = [torch.randint(-2, 3, (s, d), generator=g).double() for s in seq]
            self.q = torch.randint(-2, 3, (t, h, d), generator=g).double()
            self.weights = torch.randint(1, 3, (t, h), generator=g).double()
        else:  # values as the cache dtype rounds them, so the float64 reference scores what is read
            self.keys = [torch.randn(s, d, generator=g, dtype=torch.float64).to(self.dtype).double() for s in seq]
            self.q = torch.randn(t, h, d, generator=g, dtype=torch.float64).to(self.dtype).double()
            self.weights = torch.randn(t, h, generator=g, dtype=torch.float64).float().double()
        self.scale = d ** -0.5
        self.layer_cfg = IndexerLayerConfig(case.index_n_heads, d, case.index_topk, dtype=self.dtype,
                                            block_size=case.block_size, device=device)
        self.spec = IndexerSpec(block_size=case.block_size, index_head_dim=d, dtype=self.dtype)
        self.cm = common_metadata(case, self.block_table, device)
        self.cache = poisoned_cache(case, self.keys, self.block_table, self.num_blocks, self.dtype).to(device)
        self.impl = backend_cls.get_impl_cls()(self.layer_cfg, self.scale)

    def scores(self, token: int) -> torch.Tensor:
        """``[position + 1]`` float64 reference scores of query ``token`` over its request's keys."""
        req, pos = query_positions(self.case)[token]
        s = torch.relu(torch.einsum("hd,sd->hs", self.q[token], self.keys[req][: pos + 1]) * self.scale)
        return torch.einsum("h,hs->s", self.weights[token], s)

    def reference(self) -> torch.Tensor:
        """``[num_tokens, index_topk]`` int64: the contract's selection, ``-1`` padded."""
        k = self.case.index_topk
        out = torch.full((len(query_positions(self.case)), k), -1, dtype=torch.int64)
        for t in range(out.shape[0]):
            s = self.scores(t)
            order = sorted(range(len(s)), key=lambda j: (-float(s[j]), j))[:k]
            out[t, : len(order)] = torch.tensor(order)
        return out

    def run(self) -> SelectorRun:
        c = self.case
        md = self.backend_cls.get_builder_cls()(self.spec, ["indexer.0"], builder_config(c), self.device).build(0, self.cm)
        cache = self.cache.clone()
        new = torch.cat([k[ctx:] for k, ctx in zip(self.keys, c.num_computed_tokens)])
        pad = c.num_padded_tokens
        k_in = torch.cat([new, new.new_zeros(pad, new.shape[1])]).to(self.dtype).to(self.device)
        q_in = torch.cat([self.q, self.q.new_zeros(pad, *self.q.shape[1:])]).to(self.dtype).to(self.device)
        w_in = torch.cat([self.weights, self.weights.new_zeros(pad, self.weights.shape[1])]).float().to(self.device)
        out = torch.full((q_in.shape[0], c.index_topk), 12345, dtype=torch.int32, device=self.device)
        self.impl.forward(q_in, k_in, w_in, cache, md, out)
        return SelectorRun(c, out.cpu(), self.cache.cpu(), cache.cpu(), self.cm.slot_mapping.cpu(),
                           new.to(self.dtype))


# --- the consumer ----------------------------------------------------------------------------
@dataclass
class SparseMLARun:
    case: SparseMLACase
    output: torch.Tensor
    """``[num_tokens + num_padded_tokens, N, V]`` after ``forward``."""


class SparseMLAStep:
    """One consumer case prepared for a backend: latents, queries, weights and the selection."""

    def __init__(self, backend_cls, case: SparseMLACase, device: str, seed: int = 0):
        self.backend_cls, self.case, self.device = backend_cls, case, device
        self.dtype = getattr(torch, case.dtype)
        g = torch.Generator().manual_seed(seed)
        self.block_table, self.num_blocks, seq = block_layout(case.num_computed_tokens, case.num_scheduled_tokens,
                                                              case.block_size, g)
        lr, r, n = case.kv_lora_rank, case.qk_rope_head_dim, case.num_heads
        self.rows = [torch.randn(s, lr + r, generator=g, dtype=torch.float64).to(self.dtype).double() for s in seq]
        t = sum(case.num_scheduled_tokens)
        self.q = torch.randn(t, n, case.qk_nope_head_dim + r, generator=g, dtype=torch.float64)
        self.w_kv = torch.randn(n * (case.qk_nope_head_dim + case.v_head_dim), lr, generator=g,
                                dtype=torch.float64) / lr ** 0.5
        self.scale = (case.qk_nope_head_dim + r) ** -0.5
        self.indices = self._selection(g)
        self.layer_cfg = SparseMLALayerConfig(n, lr, case.qk_nope_head_dim, r, case.v_head_dim, dtype=self.dtype,
                                              block_size=case.block_size, device=device, index_topk=case.index_topk)
        self.spec = MLAAttentionSpec(block_size=case.block_size, kv_lora_rank=lr, qk_rope_head_dim=r, dtype=self.dtype)
        self.cm = common_metadata(case, self.block_table, device)
        self.cache = poisoned_cache(case, self.rows, self.block_table, self.num_blocks, self.dtype).to(device)
        self.impl = backend_cls.get_impl_cls()(self.layer_cfg, self.scale)

    def _selection(self, g: torch.Generator) -> torch.Tensor:
        """``[num_tokens, index_topk]`` int64: a random subset of each query's causal keys
        (never position 0 unless it is the only key, so a ``-1`` read as 0 shows), ``-1``
        interleaved when ``minus_ones``, else every slot used where the query sees enough keys."""
        k = self.case.index_topk
        out = torch.full((len(query_positions(self.case)), k), -1, dtype=torch.int64)
        for t, (_, pos) in enumerate(query_positions(self.case)):
            pool = torch.arange(1, pos + 1) if pos else torch.tensor([0])
            take = min(len(pool), k - 1 if self.case.minus_ones and k > 1 else k)
            chosen = pool[torch.randperm(len(pool), generator=g)[:take]]
            slots = torch.randperm(k, generator=g)[:take]
            out[t, slots] = chosen
        return out

    def reference(self) -> torch.Tensor:
        """``[num_tokens, N, V]`` float64: expanded attention over the selected keys only."""
        c = self.case
        n, p, v = c.num_heads, c.qk_nope_head_dim, c.v_head_dim
        w = self.w_kv.view(n, p + v, c.kv_lora_rank)
        outs = []
        for t, (req, pos) in enumerate(query_positions(c)):
            sel = self.indices[t][self.indices[t] >= 0]
            rows = self.rows[req][sel]
            k = torch.cat([torch.einsum("sl,npl->snp", rows[:, : c.kv_lora_rank], w[:, :p]),
                           rows[:, c.kv_lora_rank:].unsqueeze(1).expand(-1, n, -1)], dim=-1)
            vals = torch.einsum("sl,nvl->snv", rows[:, : c.kv_lora_rank], w[:, p:])
            s = torch.einsum("nd,snd->ns", self.q[t], k) * self.scale
            outs.append(torch.einsum("ns,snv->nv", torch.softmax(s, -1), vals))
        return torch.stack(outs)

    def run(self, indices: torch.Tensor | None = None) -> SparseMLARun:
        c = self.case
        md = self.backend_cls.get_builder_cls()(self.spec, ["mla.0"], builder_config(c), self.device).build(0, self.cm)
        pad = c.num_padded_tokens
        new = torch.cat([r[ctx:] for r, ctx in zip(self.rows, c.num_computed_tokens)])
        new = torch.cat([new, new.new_zeros(pad, new.shape[1])]).to(self.dtype).to(self.device)
        q = torch.cat([self.q, self.q.new_zeros(pad, *self.q.shape[1:])]).to(self.dtype).to(self.device)
        idx = self.indices if indices is None else indices
        idx = torch.cat([idx, idx.new_full((pad, idx.shape[1]), -1)]).to(torch.int32).to(self.device)
        out = torch.full((q.shape[0], c.num_heads, c.v_head_dim), OUTPUT_SENTINEL, dtype=self.dtype,
                         device=self.device)
        layer = SimpleNamespace(kv_b_proj=SimpleNamespace(weight=self.w_kv.to(self.dtype).to(self.device)))
        lr = c.kv_lora_rank
        self.impl.forward(layer, q, new[:, :lr], new[:, lr:], self.cache.clone(), md, out, topk_indices=idx)
        return SparseMLARun(c, out.cpu())
