"""Which slice of a Qwen3-Next / Qwen3.5 weight a tensor-parallel rank holds: the Gated
DeltaNet layers (``linear_attn``), the gated full attention's ``q_proj`` and the shared
expert of the mixture of experts. :func:`attnplug.runner.parallel.sharding.shard_tensor`
asks here first for these families and falls back to the Llama rules for the rest
(``k_proj``/``v_proj``, ``o_proj``, the dense MLP, the routed experts).

For ``tp`` ranks with ``Kl = linear_num_key_heads / tp`` key heads and ``Vl =
linear_num_value_heads / tp`` value heads per rank, rank ``r`` holds key heads
``[r Kl, (r+1) Kl)`` and value heads ``[r Vl, (r+1) Vl)``. Value head ``h`` reads key head
``h // (V/K)`` (HF repeats q and k ``V/K`` times), so the rank's value heads read exactly its
key heads and no state, conv channel or head crosses ranks:

* ``in_proj_qkvz`` (layout ``qwen3_next``; rows grouped per key head: q, k, then the head's
  ``V/K`` value heads of v, then of z) and ``in_proj_ba`` (per key head ``V/K`` rows of b,
  then of a): the rank's key-head groups, contiguous rows;
* ``in_proj_qkv`` (layout ``qwen3_5``; q, k, v flat) and ``conv1d.weight`` (channels q | k |
  v, as the conv sees them in both layouts): the rank's q rows, k rows and v rows;
* ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``dt_bias``, ``A_log``: the rank's value heads;
* ``norm.weight`` (``[head_v_dim]``, one norm per head): whole;
* ``out_proj``: the rank's value channels' input columns (row-parallel, all-reduce);
* gated attention ``q_proj`` (per head ``head_dim`` query rows then ``head_dim`` gate rows):
  the rank's heads' ``2 head_dim`` rows each (the gate stays with its head);
* ``mlp.shared_expert.{gate,up}_proj``: rows ``[r I_s/tp, (r+1) I_s/tp)`` of
  ``shared_expert_intermediate_size``; ``down_proj`` the matching input columns; the scalar
  ``shared_expert_gate`` whole (``sigmoid(g(x)) * sum_r part_r = sum_r sigmoid(g(x)) part_r``,
  so the sparse block all-reduces routed and shared partial sums together, once).
"""

from __future__ import annotations

from typing import Any

import torch

_GDN = ".linear_attn."


def _part(size: int, tp: int, rank: int) -> slice:
    per = size // tp
    return slice(rank * per, (rank + 1) * per)


def _gdn_tensor(name: str, t: torch.Tensor, cfg: Any, tp: int, rank: int) -> torch.Tensor:
    K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    heads_v = _part(V, tp, rank)
    vals = _part(V * dv, tp, rank)
    if name.endswith((".in_proj_qkvz.weight", ".in_proj_ba.weight")):  # per key-head groups, contiguous
        return t[_part(t.shape[0], tp, rank)]
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):  # q | k | v
        q, k, v = t.split([K * dk, K * dk, V * dv])
        keys = _part(K * dk, tp, rank)
        return torch.cat([q[keys], k[keys], v[vals]])
    if name.endswith(".in_proj_z.weight"):
        return t[vals]
    if name.endswith((".in_proj_b.weight", ".in_proj_a.weight", ".dt_bias", ".A_log")):
        return t[heads_v]
    if name.endswith(".out_proj.weight"):
        return t[:, vals]
    return t  # norm.weight: per head, whole


def qwen3_next_tensor(name: str, t: torch.Tensor, cfg: Any, tp: int, rank: int) -> torch.Tensor | None:
    """Rank ``rank``'s slice of Qwen3-Next / Qwen3.5 tensor ``name`` (module docstring), or
    ``None`` when the family's generic rule applies (``sharding.shard_tensor``)."""
    if _GDN in name:
        return _gdn_tensor(name, t, cfg, tp, rank)
    if ".self_attn.q_proj." in name:  # query and gate rows of each head
        return t[_part(t.shape[0], tp, rank)]
    if ".mlp.shared_expert." in name:
        if name.endswith(".down_proj.weight"):
            return t[:, _part(t.shape[1], tp, rank)]
        return t[_part(t.shape[0], tp, rank)]
    return None


def qwen3_next_problems(cfg: Any, tp: int) -> list[str]:
    """Why a Qwen3-Next / Qwen3.5 config does not split over ``tp`` ranks (empty: it does)."""
    problems = []
    if cfg.linear_num_key_heads % tp:
        problems.append(f"linear_num_key_heads {cfg.linear_num_key_heads} is not a multiple of {tp}")
    if cfg.moe is not None and cfg.shared_expert_intermediate_size % tp:
        problems.append(f"shared_expert_intermediate_size {cfg.shared_expert_intermediate_size} is not a "
                        f"multiple of {tp}")
    return problems


def qwen3_next_rank_sizes(cfg: Any, tp: int) -> dict[str, int]:
    """The fields of the rank's config that differ for these families (``shard_config``)."""
    return dict(linear_num_key_heads=cfg.linear_num_key_heads // tp,
                linear_num_value_heads=cfg.linear_num_value_heads // tp,
                shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp)


__all__ = ["qwen3_next_problems", "qwen3_next_rank_sizes", "qwen3_next_tensor"]
