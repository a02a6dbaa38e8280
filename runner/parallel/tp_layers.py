"""The tensor-parallel modules that replace a rank model's row-parallel and vocabulary layers.

Each keeps the HF parameter names (``weight``, ``bias``) of the ``nn.Linear`` /
``nn.Embedding`` it replaces, so :func:`sharding.shard_state_dict` output loads strictly.
Collectives go through ``torch.distributed`` on the rank's tensor-parallel group and are
timed into the state's :class:`~attnplug.runner.parallel.state.CollectiveTimer`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from attnplug.runner.parallel.sharding import cdiv
from attnplug.runner.parallel.state import ParallelState


def all_reduce_sum(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """``x`` summed over the tensor-parallel ranks (in place; returns ``x``)."""
    t0 = time.perf_counter_ns()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=state.tp_group)
    state.timer.ns += time.perf_counter_ns() - t0
    state.timer.calls += 1
    return x


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x_r @ W_r^T) + b``: the rank holds input columns ``W_r`` of the full
    weight (``[out_features, in_features / tp]``) and the whole bias, added once after the sum.

    Args:
        in_features: the rank's share of the input features.
        out_features: the full output size (``hidden_size``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, state: ParallelState,
                 dtype: torch.dtype, device):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce_sum(nn.functional.linear(x, self.weight), self.state)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows ``[r * Vp, (r+1) * Vp)`` (``Vp = cdiv(vocab_size, tp)``): ids outside
    the rank's range look up zeros, and the all-reduce sums the one rank that has each row.

    ``input_ids``: ``[num_tokens]`` int64 -> ``[num_tokens, hidden_size]``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, state: ParallelState, dtype: torch.dtype, device):
        per = cdiv(vocab_size, state.tp_size)
        super().__init__(per, hidden_size, dtype=dtype, device=device)
        self.state, self.vocab_start = state, state.tp_rank * per

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce_sum(out, self.state)


class ParallelLMHead(nn.Linear):
    """LM head rows ``[r * Vp, (r+1) * Vp)``; ``forward`` all-gathers the shards so that every
    rank has the full ``[n, vocab_size]`` logits (and samples the same tokens; see
    docs/distributed.md, "Sampling")."""

    def __init__(self, vocab_size: int, hidden_size: int, state: ParallelState, dtype: torch.dtype, device):
        super().__init__(hidden_size, cdiv(vocab_size, state.tp_size), bias=False, dtype=dtype, device=device)
        self.state, self.vocab_size = state, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = nn.functional.linear(hidden, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.state.tp_size)]
        t0 = time.perf_counter_ns()
        dist.all_gather(parts, local, group=self.state.tp_group)
        self.state.timer.ns += time.perf_counter_ns() - t0
        self.state.timer.calls += 1
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


class ParallelGatedRMSNorm(nn.Module):
    """The Mamba2 gated norm over one B/C group that is split across all ranks
    (``mamba_n_groups == 1``): ``weight_r * h_r / sqrt(sum_ranks(sum(h^2)) / full_size + eps)``
    with ``h = y * silu(z)``, the rank holding channels ``h_r`` (float32, as
    ``runner.models.mamba2.GatedRMSNorm``)."""

    def __init__(self, local_size: int, full_size: int, eps: float, state: ParallelState, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_size, dtype=dtype, device=device))
        self.full_size, self.eps, self.state = full_size, eps, state

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float() * nn.functional.silu(gate.float())
        sq = all_reduce_sum(h.pow(2).sum(-1, keepdim=True), self.state)
        return self.weight * (h * torch.rsqrt(sq / self.full_size + self.eps)).to(x.dtype)
