"""Running one MLA case on a backend, and the float64 expanded reference it is judged by.

The cache starts as NaN everywhere (the null block, unused blocks, the tail of each
request's last block); only the context rows of the case's requests are written. A
backend that reads a row no query may read gets NaN in its output. The reference is the
textbook form: up-project every cached latent to per-head ``k``/``v`` in float64 and run
causal softmax attention (docs/mla.md).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import torch

from attnplug.cache_groups.specs import MLAAttentionSpec, cdiv
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import BuilderConfig
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.mla import MLALayerConfig
from attnplug.plugins.conformance.mla_cases import MLACase

OUTPUT_SENTINEL = 7.0
"""What every output row holds before ``forward``; padded rows must keep it."""

TOLERANCE = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}
"""Max abs error vs the float64 reference, relative to the output's max magnitude (>= 1)."""


@dataclass
class MLAInputs:
    """A case's random tensors (CPU, float64 masters) and its block layout."""

    case: MLACase
    kv_c: list[torch.Tensor]
    """Per request ``[seq_len, L]``: the latent of every position (context and new)."""
    k_pe: list[torch.Tensor]
    """Per request ``[seq_len, R]``."""
    q: torch.Tensor
    """``[num_tokens, N, P + R]``: the queries of the step's tokens."""
    w_kv: torch.Tensor
    """``[N * (P + V), L]``: ``kv_b_proj.weight``."""
    block_table: np.ndarray
    """``[num_reqs, max_blocks]``, distinct blocks >= 1, ``NULL_BLOCK_ID`` past each request's."""
    num_blocks: int
    scale: float


def make_inputs(case: MLACase, seed: int = 0) -> MLAInputs:
    """Deterministic inputs for ``case`` (shuffled, non-contiguous block ids)."""
    g = torch.Generator().manual_seed(seed)
    n, lr, r = case.num_reqs, case.kv_lora_rank, case.qk_rope_head_dim
    seq = [c + s for c, s in zip(case.num_computed_tokens, case.num_scheduled_tokens)]
    need = [cdiv(s, case.block_size) for s in seq]
    num_blocks = sum(need) + 4
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    bt = np.zeros((n, max(max(need), 1) + 1), dtype=np.int64)
    for i, k in enumerate(need):
        bt[i, :k] = [perm.pop() for _ in range(k)]
    kv_c = [torch.randn(s, lr, generator=g, dtype=torch.float64) for s in seq]
    k_pe = [torch.randn(s, r, generator=g, dtype=torch.float64) for s in seq]
    t = sum(case.num_scheduled_tokens)
    q = torch.randn(t, case.num_heads, case.qk_nope_head_dim + r, generator=g, dtype=torch.float64)
    w = torch.randn(case.num_heads * (case.qk_nope_head_dim + case.v_head_dim), lr, generator=g,
                    dtype=torch.float64) / lr ** 0.5
    return MLAInputs(case, kv_c, k_pe, q, w, bt, num_blocks, (case.qk_nope_head_dim + r) ** -0.5)


def reference_output(inp: MLAInputs) -> torch.Tensor:
    """``[num_tokens, N, V]`` float64: expanded attention of each query over its request's
    keys ``0 .. position`` (causal)."""
    c = inp.case
    n_h, p, v_dim = c.num_heads, c.qk_nope_head_dim, c.v_head_dim
    w = inp.w_kv.view(n_h, p + v_dim, c.kv_lora_rank)
    outs, t = [], 0
    for i, (ctx, q_len) in enumerate(zip(c.num_computed_tokens, c.num_scheduled_tokens)):
        k_nope = torch.einsum("sl,npl->snp", inp.kv_c[i], w[:, :p])
        k = torch.cat([k_nope, inp.k_pe[i].unsqueeze(1).expand(-1, n_h, -1)], dim=-1)
        v = torch.einsum("sl,nvl->snv", inp.kv_c[i], w[:, p:])
        q = inp.q[t: t + q_len]
        s = torch.einsum("qnd,snd->nqs", q, k) * inp.scale
        pos = ctx + torch.arange(q_len)
        s = s.masked_fill(torch.arange(ctx + q_len).unsqueeze(0) > pos.unsqueeze(1), float("-inf"))
        outs.append(torch.einsum("nqs,snv->qnv", torch.softmax(s, -1), v))
        t += q_len
    return torch.cat(outs) if outs else inp.q.new_zeros(0, n_h, v_dim)


@dataclass
class MLARun:
    """What one run produced (all on CPU)."""

    case: MLACase
    output: torch.Tensor
    """``[num_tokens + num_padded_tokens, N, V]`` after ``forward``."""
    cache_before: torch.Tensor
    cache_after: torch.Tensor
    slot_mapping: torch.Tensor
    new_rows: torch.Tensor
    """``[num_tokens, L + R]`` in the cache dtype: what each new token's slot must hold."""
    num_decodes: int
    num_chunks: int


class MLAStep:
    """One case's step prepared for a backend: metadata, cache, layer, impl inputs."""

    def __init__(self, backend_cls, case: MLACase, device: str, seed: int = 0):
        self.backend_cls, self.case, self.device = backend_cls, case, device
        self.inp = make_inputs(case, seed)
        self.dtype = getattr(torch, case.dtype)
        self.layer_cfg = MLALayerConfig(case.num_heads, case.kv_lora_rank, case.qk_nope_head_dim,
                                        case.qk_rope_head_dim, case.v_head_dim, dtype=self.dtype,
                                        block_size=case.block_size, device=device)
        self.spec = MLAAttentionSpec(block_size=case.block_size, kv_lora_rank=case.kv_lora_rank,
                                     qk_rope_head_dim=case.qk_rope_head_dim, dtype=self.dtype)
        self.cm = self._metadata()
        self.cache = self._cache()
        # created before any build: planning builders read the live impls' parameters
        self.impl = backend_cls.get_impl_cls()(self.layer_cfg, self.inp.scale)

    def _metadata(self) -> CommonAttentionMetadata:
        c = self.case
        cm = CommonAttentionMetadata.from_lengths(list(c.num_computed_tokens), list(c.num_scheduled_tokens),
                                                  self.inp.block_table.tolist(), c.block_size, device=self.device)
        if c.num_padded_tokens:
            pad = torch.full((c.num_padded_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=self.device)
            cm = cm.replace(slot_mapping=torch.cat([cm.slot_mapping, pad]),
                            positions=torch.cat([cm.positions, torch.zeros_like(pad)]))
        return cm

    def _cache(self) -> torch.Tensor:
        c, inp = self.case, self.inp
        cache = torch.full((inp.num_blocks, c.block_size, c.kv_lora_rank + c.qk_rope_head_dim), float("nan"),
                           dtype=self.dtype)
        for i, ctx in enumerate(c.num_computed_tokens):
            for pos in range(ctx):
                row = torch.cat([inp.kv_c[i][pos], inp.k_pe[i][pos]])
                cache[inp.block_table[i, pos // c.block_size], pos % c.block_size] = row.to(self.dtype)
        return cache.to(self.device)

    def new_latent(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_c_normed`` ``[T, L]`` and ``k_pe`` ``[T, R]`` of the step's tokens (padded rows: zeros)."""
        c, inp = self.case, self.inp
        kv = [inp.kv_c[i][ctx:] for i, ctx in enumerate(c.num_computed_tokens)]
        pe = [inp.k_pe[i][ctx:] for i, ctx in enumerate(c.num_computed_tokens)]
        kv_c, k_pe = torch.cat(kv), torch.cat(pe)
        pad = c.num_padded_tokens
        kv_c = torch.cat([kv_c, kv_c.new_zeros(pad, kv_c.shape[1])])
        k_pe = torch.cat([k_pe, k_pe.new_zeros(pad, k_pe.shape[1])])
        return kv_c.to(self.dtype).to(self.device), k_pe.to(self.dtype).to(self.device)

    def builder(self, workspace_tokens: int | None = None, max_num_reqs: int | None = None):
        cls = self.backend_cls.get_builder_cls()
        n, seq = max_num_reqs or self.case.num_reqs, [a + b for a, b in zip(self.case.num_computed_tokens,
                                                            self.case.num_scheduled_tokens)]
        cfg = BuilderConfig(max_num_reqs=max(n, 1), max_num_batched_tokens=max(1, sum(self.case.num_scheduled_tokens)),
                            max_model_len=max(seq) + 1)
        kwargs = {}
        if workspace_tokens is not None and "workspace_tokens" in inspect.signature(cls.__init__).parameters:
            kwargs["workspace_tokens"] = workspace_tokens
        return cls(self.spec, ["mla.0"], cfg, self.device, **kwargs)

    def forward(self, metadata, cache: torch.Tensor | None = None) -> torch.Tensor:
        """Run one layer on ``cache`` (default: this step's) and return the output (device)."""
        c = self.case
        impl = self.impl
        layer = SimpleNamespace(kv_b_proj=SimpleNamespace(weight=self.inp.w_kv.to(self.dtype).to(self.device)))
        kv_c, k_pe = self.new_latent()
        q = self.inp.q.to(self.dtype).to(self.device)
        q = torch.cat([q, q.new_zeros(c.num_padded_tokens, *q.shape[1:])])
        out = torch.full((q.shape[0], c.num_heads, c.v_head_dim), OUTPUT_SENTINEL, dtype=self.dtype,
                         device=self.device)
        impl.forward(layer, q, kv_c, k_pe, self.cache if cache is None else cache, metadata, out)
        return out

    def run(self, workspace_tokens: int | None = None, threshold: int | None = None) -> MLARun:
        """Build (optionally with another decode threshold) and run on a copy of the cache."""
        builder = self.builder(workspace_tokens if workspace_tokens is not None else self.case.workspace_tokens)
        if threshold is not None:
            builder.reorder_batch_threshold = threshold
        md = builder.build(0, self.cm)
        cache = self.cache.clone()
        out = self.forward(md, cache)
        kv_c, k_pe = self.new_latent()
        t = sum(self.case.num_scheduled_tokens)
        return MLARun(self.case, out.cpu(), self.cache.cpu(), cache.cpu(), self.cm.slot_mapping.cpu(),
                      torch.cat([kv_c, k_pe], -1)[:t].cpu(), getattr(md, "num_decodes", -1),
                      len(getattr(getattr(md, "prefill", None), "chunks", ()) or ()))


def with_dtype(case: MLACase, dtype: str) -> MLACase:
    return replace(case, name=f"{case.name}_{dtype}", dtype=dtype)
