"""The mixture-of-experts MLP, once for every family: router, routed experts, shared experts.

``MoEBlock(cfg)`` holds, under HF's parameter names so that a state dict loads key for key:

    {gate|router}.weight                   [E, H]   (float32 when ``cfg.router_fp32``)
    {gate|router}.bias                     [E]      (gpt-oss)
    gate.e_score_correction_bias           [E]      (``noaux_tc``, float32)
    experts.gate_up_proj                   [E, 2I, H] gate rows then up rows (``swiglu``), or
                                           [E, H, 2I] gate/up columns interleaved (gpt-oss)
    experts.gate_up_proj_bias              [E, 2I]  (gpt-oss, interleaved)
    experts.down_proj                      [E, H, I] (``swiglu``) or [E, I, H] (gpt-oss)
    experts.down_proj_bias                 [E, H]   (gpt-oss)
    shared_experts.{gate,up,down}_proj     SwiGLU of width I * n_shared_experts (DeepSeek)

Conventions (transformers 5.24's ``Qwen3MoeSparseMoeBlock``, ``DeepseekV2Moe``,
``DeepseekV3MoE``, ``GptOssMLP``; facts, not code): the router's formulas are in
:meth:`Router.forward`; each chosen expert's output is multiplied by its weight and the
products are summed per token in ascending expert order; shared experts are added after.

The experts run vectorised: the ``num_tokens * k`` (token, expert) pairs are sorted by
expert, each expert with tokens does one matmul over its contiguous rows, and one
``index_add_`` scatters the weighted rows back. There is no Python loop over tokens; the
loop over experts needs the per-expert counts on the host (one device sync per MoE layer,
so a MoE layer is not CUDA-graph capturable on this path).

Tensor parallel (``runner/parallel``): each rank holds every expert's slice of the
intermediate dimension, the router whole; the block's output is then a partial sum that
``reduce`` (set by the parallel layer) all-reduces once, routed and shared parts together.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from attnplug.runner.models.layers import SwiGLUMLP
from attnplug.runner.models.moe_config import MoEConfig

NOAUX_TC_EPS = 1e-20
"""Added to the sum of the k weights before ``noaux_tc`` renormalises (DeepSeek-V3)."""


def _group_mask(choice: torch.Tensor, cfg: MoEConfig, group_score: str) -> torch.Tensor:
    """``[num_tokens, E]`` bool: the experts of each token's ``topk_group`` best groups, a group
    scored by its best expert (``max``) or by the sum of its best two (``top2``)."""
    n = choice.shape[0]
    grouped = choice.view(n, cfg.n_group, cfg.num_experts // cfg.n_group)
    scores = grouped.max(dim=-1).values if group_score == "max" else grouped.topk(2, dim=-1).values.sum(dim=-1)
    chosen = scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape(n, cfg.num_experts)


class Router(nn.Module):
    """Chooses ``k`` experts per token and their weights (see :class:`MoEConfig` for the kinds)."""

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype, device):
        super().__init__()
        self.cfg = cfg
        wdtype = torch.float32 if cfg.router_fp32 else dtype
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size, dtype=wdtype, device=device))
        self.bias = (nn.Parameter(torch.zeros(cfg.num_experts, dtype=wdtype, device=device))
                     if cfg.router_bias else None)
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.num_experts, dtype=torch.float32, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``x`` ``[num_tokens, hidden_size]``.

        ``logits = x W^T (+ b)`` (float32 when ``router_fp32``), then by ``topk_method``:

        * ``topk_softmax``: the k largest logits, weights ``softmax`` over those k.
        * otherwise ``s = softmax(logits)`` (float32) or ``sigmoid(logits)``, and the k experts
          with the largest ``s`` (``greedy``); among the ``topk_group`` groups with the largest
          ``max(s)`` (``group_limited_greedy``); or with the largest ``s + e_score_correction_bias``
          among the groups with the largest sum of their top-2 biased scores (``noaux_tc``).
          Weights: ``s`` of the chosen experts (never biased), divided by their sum when
          ``norm_topk_prob`` (plus 1e-20 for ``noaux_tc``), times ``routed_scaling_factor``.

        Returns:
            ``(topk_weights, topk_ids)``: ``[num_tokens, k]`` float32 (``router_fp32``) or
            ``x.dtype``, and ``[num_tokens, k]`` int64 expert indices.
        """
        cfg = self.cfg
        if cfg.router_fp32:
            logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        else:
            logits = F.linear(x, self.weight, self.bias)
        if cfg.topk_method == "topk_softmax":
            top, ids = logits.topk(cfg.num_experts_per_tok, dim=-1)
            return top.softmax(dim=-1), ids
        scores = logits.softmax(dim=-1, dtype=torch.float32) if cfg.scoring_func == "softmax" else logits.sigmoid()
        if cfg.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias
            choice = choice.masked_fill(~_group_mask(choice, cfg, "top2"), float("-inf"))
            ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
        else:
            if cfg.topk_method == "group_limited_greedy":
                scores = scores.masked_fill(~_group_mask(scores, cfg, "max"), 0.0)
            weights, ids = scores.topk(cfg.num_experts_per_tok, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (NOAUX_TC_EPS if cfg.topk_method == "noaux_tc"
                                                                     else 0.0))
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        return (weights if cfg.router_fp32 else weights.to(x.dtype)), ids


class Experts(nn.Module):
    """``E`` expert MLPs stored as 3-D tensors (HF's fused layout; see the module docstring)."""

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype, device):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.clamped = cfg.expert_kind == "swiglu_clamp"
        kw = dict(dtype=dtype, device=device)
        up_shape, down_shape = ((E, H, 2 * I), (E, I, H)) if self.clamped else ((E, 2 * I, H), (E, H, I))
        self.gate_up_proj = nn.Parameter(torch.zeros(up_shape, **kw))
        self.down_proj = nn.Parameter(torch.zeros(down_shape, **kw))
        if cfg.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I, **kw))
            self.down_proj_bias = nn.Parameter(torch.zeros(E, H, **kw))
        self.add_down_bias = True
        """Add ``down_proj_bias`` (tensor parallel: on one rank only, the sum counts it once)."""

    def expert_mlp(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on its tokens ``x`` ``[m, hidden_size]`` -> ``[m, hidden_size]`` (unweighted)."""
        if not self.clamped:
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, self.down_proj[e])
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        limit = self.cfg.swiglu_limit
        gate = gate_up[..., 0::2].clamp(max=limit)
        up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.cfg.swiglu_alpha))
        out = h @ self.down_proj[e]
        return out + self.down_proj_bias[e] if self.add_down_bias else out

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for every token ``t``.

        Args:
            x: ``[num_tokens, hidden_size]``, model dtype.
            topk_weights: ``[num_tokens, k]``, float32 or model dtype.
            topk_ids: ``[num_tokens, k]`` int64 in ``[0, E)``.

        Returns:
            ``[num_tokens, hidden_size]`` in ``x.dtype``. Synchronises with the host once
            (per-expert token counts).
        """
        n, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
        token_of = order // k
        counts = torch.bincount(flat_ids, minlength=self.cfg.num_experts).tolist()
        rows = x[token_of]
        out = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts):
            if count:
                out[start:start + count] = self.expert_mlp(e, rows[start:start + count])
                start += count
        weighted = (out * topk_weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, weighted)


class MoEBlock(nn.Module):
    """Router + routed experts (+ shared experts): ``[num_tokens, hidden_size]`` -> same shape.

    Attributes:
        reduce: ``None``, or (tensor parallel) the all-reduce applied to the block's partial sum.
    """

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype, device):
        super().__init__()
        self.cfg = cfg
        self.router_name = cfg.router_name
        self.add_module(cfg.router_name, Router(cfg, dtype, device))
        self.experts = Experts(cfg, dtype, device)
        self.shared_experts = (SwiGLUMLP(cfg.hidden_size, cfg.shared_intermediate_size, False, dtype, device)
                               if cfg.num_shared_experts else None)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def get_router(self) -> Router:
        """The router (HF names it ``gate``, or ``router`` in gpt-oss)."""
        return self._modules[self.router_name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``, same dtype."""
        weights, ids = self.get_router()(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if self.reduce is None else self.reduce(out)

    @torch.no_grad()
    def init_weights(self, gen: torch.Generator | None, std: float) -> None:
        """HF-style random init: weight matrices ``N(0, std)`` (CPU ``gen``), biases and the
        score-correction bias 0."""
        for name, p in self.named_parameters():
            if name.endswith(("bias", "_bias")):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))


def naive_moe_forward(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """The same result as ``block(x)`` by a Python loop over tokens and their k experts (the
    baseline of ``attnplug bench moe``; never used by the models)."""
    weights, ids = block.get_router()(x)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t:t + 1])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            acc = acc + (block.experts.expert_mlp(e, x[t:t + 1]) * weights[t, j]).to(x.dtype)
        rows.append(acc)
    out = torch.cat(rows) if rows else torch.zeros_like(x)
    if block.shared_experts is not None:
        out = out + block.shared_experts(x)
    return out


__all__ = ["Experts", "MoEBlock", "NOAUX_TC_EPS", "Router", "naive_moe_forward"]
