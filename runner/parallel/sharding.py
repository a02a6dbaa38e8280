"""Which slice of each HF weight a tensor-parallel rank holds (Megatron-LM's split, as vLLM's).

For ``tp`` ranks, rank ``r`` holds:

* query heads ``[r * H/tp, (r+1) * H/tp)`` (``H % tp == 0`` required);
* KV heads ``[r * K/tp, (r+1) * K/tp)`` when ``K >= tp`` (``K % tp == 0``), else the one
  KV head ``r * K // tp``, *replicated* on ``tp / K`` ranks (``tp % K == 0``): its query
  heads all read that KV head, since ``r*H/tp // (H/K) == r*K // tp``;
* column-parallel ``q/k/v_proj``, ``gate_proj``, ``up_proj``: those output rows (and bias
  entries); row-parallel ``o_proj``, ``down_proj``: those input columns, the bias whole
  (added once, after the all-reduce: ``tp_layers.RowParallelLinear``);
* vocab-parallel ``embed_tokens`` / ``lm_head``: rows ``[r * Vp, (r+1) * Vp)`` with
  ``Vp = cdiv(V, tp)``, the last shard zero-padded;
* mixture-of-experts MLPs (``runner/models/moe.py``): every expert's slice of the
  intermediate dimension ``[r * I/tp, (r+1) * I/tp)``: the gate and up rows of
  ``experts.gate_up_proj [E, 2I, H]`` (gpt-oss: the interleaved gate/up columns of
  ``[E, H, 2I]`` and of their bias), the input columns of ``experts.down_proj [E, H, I]``
  (gpt-oss: rows of ``[E, I, H]``; its bias whole, added on rank 0 only); shared experts as
  a SwiGLU of their width; the router whole (every rank routes every token the same way);
* multi-head latent attention (DeepSeek, ``runner/models/deepseek.py``): the rank's heads'
  rows of ``q_proj`` / ``q_b_proj`` (``qk_nope_head_dim + qk_rope_head_dim`` each) and of
  ``kv_b_proj`` (``qk_nope_head_dim + v_head_dim`` each), their ``v_head_dim`` input columns
  of ``o_proj``; ``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms whole, so every rank
  computes and caches the same latent rows (the latent cache is per rank, replicated);
* Qwen3-Next / Qwen3.5: Gated DeltaNet key and value heads, the gated ``q_proj`` and the
  shared expert as ``runner/parallel/gdn_sharding.py`` describes;
* everything else (norms, Gemma's and Qwen3's per-head ``q_norm``/``k_norm``) whole.

The rank model is the same family's model built from :func:`shard_config` (heads and
intermediate size divided), so its backends and KV caches see only the rank's heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from attnplug.runner.parallel.gdn_sharding import qwen3_next_problems, qwen3_next_rank_sizes, qwen3_next_tensor
from attnplug.runner.parallel.state import ParallelConfigError

COLUMN = ("mlp.gate_proj", "mlp.up_proj", "feed_forward.gate_proj", "feed_forward.up_proj")
DOWN = (".mlp.down_proj.weight", ".feed_forward.down_proj.weight")
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_head_range(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the KV heads rank ``rank`` holds (see the module docstring)."""
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return rank * per, (rank + 1) * per
    head = rank * num_kv_heads // tp
    return head, head + 1


def check_shardable(cfg: Any, tp: int) -> None:
    """Raise :class:`ParallelConfigError` unless ``cfg`` splits over ``tp`` ranks.

    Needs ``num_attention_heads % tp == 0``, ``num_key_value_heads`` a multiple or a
    divisor of ``tp``, ``intermediate_size % tp == 0``; for Mamba2 layers also
    ``mamba_n_heads % tp == 0``, for a mixture of experts ``moe_intermediate_size % tp == 0``,
    ``mamba_n_groups`` 1 or a multiple of ``tp`` (B/C groups
    replicated or split; a norm group split over some ranks only is not supported) and
    ``mamba_expand % tp == 0`` (the rank config keeps ``mamba_expand * hidden_size ==
    heads * head_size``); for Qwen3-Next / Qwen3.5 ``linear_num_key_heads % tp == 0`` and
    ``shared_expert_intermediate_size % tp == 0`` (``gdn_sharding.qwen3_next_problems``).
    A ``qwen2_vl`` config is refused whatever ``tp`` (its vision tower is not sharded).
    """
    if getattr(cfg, "model_type", None) == "qwen2_vl":  # docs/models.md: nothing shards its vision tower
        raise ParallelConfigError("qwen2_vl (images) runs in one process only, not under tensor or pipeline "
                                  "parallel: nothing shards its vision tower")
    H, K, I = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    problems = []
    if hasattr(cfg, "mamba_n_heads"):
        G = cfg.mamba_n_groups
        if cfg.mamba_n_heads % tp:
            problems.append(f"mamba_n_heads {cfg.mamba_n_heads} is not a multiple of {tp}")
        if G != 1 and G % tp:
            problems.append(f"mamba_n_groups {G} is neither 1 nor a multiple of {tp}")
        if cfg.mamba_expand % tp:
            problems.append(f"mamba_expand {cfg.mamba_expand} is not a multiple of {tp}")
    if hasattr(cfg, "linear_num_value_heads"):
        problems += qwen3_next_problems(cfg, tp)
    if H % tp:
        problems.append(f"num_attention_heads {H} is not a multiple of {tp}")
    if K % tp and tp % K:
        problems.append(f"num_key_value_heads {K} neither divides nor is a multiple of {tp}")
    if I % tp:
        problems.append(f"intermediate_size {I} is not a multiple of {tp}")
    moe = getattr(cfg, "moe", None)
    if moe is not None and moe.moe_intermediate_size % tp:
        problems.append(f"moe_intermediate_size {moe.moe_intermediate_size} is not a multiple of {tp}")
    if problems:
        raise ParallelConfigError(f"--tensor-parallel-size {tp} does not split {cfg.model_type}: "
                                  + "; ".join(problems))


def shard_config(cfg: Any, tp: int) -> Any:
    """The config of one rank's model: ``H/tp`` query heads, ``max(1, K/tp)`` KV heads,
    ``intermediate_size / tp``, ``moe_intermediate_size / tp`` (Qwen3-Next / Qwen3.5: GDN key and
    value heads and ``shared_expert_intermediate_size`` too); every other field (``hidden_size``, ``head_size``,
    ``vocab_size``...) unchanged. Raises :class:`ParallelConfigError` (:func:`check_shardable`)."""
    check_shardable(cfg, tp)
    mamba = {}
    if hasattr(cfg, "mamba_n_heads"):
        mamba = dict(mamba_n_heads=cfg.mamba_n_heads // tp, mamba_expand=cfg.mamba_expand // tp,
                     mamba_n_groups=max(1, cfg.mamba_n_groups // tp))
    if getattr(cfg, "moe", None) is not None:
        mamba["moe"] = dataclasses.replace(cfg.moe, moe_intermediate_size=cfg.moe.moe_intermediate_size // tp)
    if hasattr(cfg, "linear_num_value_heads"):
        mamba.update(qwen3_next_rank_sizes(cfg, tp))
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                               num_key_value_heads=max(1, cfg.num_key_value_heads // tp),
                               intermediate_size=cfg.intermediate_size // tp, **mamba)


def _rows(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return t[start:stop]


def _vocab_rows(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    per = cdiv(t.shape[0], tp)
    out = t.new_zeros((per, *t.shape[1:]))
    part = t[rank * per:(rank + 1) * per]
    out[:part.shape[0]] = part
    return out


def shard_tensor(name: str, t: torch.Tensor, cfg: Any, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of the full HF tensor ``name`` of a model of config ``cfg``."""
    D = cfg.head_size
    if name in VOCAB:
        return _vocab_rows(t, tp, rank)
    if hasattr(cfg, "linear_num_value_heads"):
        part = qwen3_next_tensor(name, t, cfg, tp, rank)
        if part is not None:
            return part
    if ".self_attn.q_proj." in name or ".self_attn.q_b_proj." in name:
        per = cfg.num_attention_heads // tp
        return _rows(t, rank * per * D, (rank + 1) * per * D)
    if ".self_attn.kv_b_proj." in name:  # MLA: per head the k_nope rows, then the v rows
        per = cfg.num_attention_heads // tp * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return _rows(t, rank * per, (rank + 1) * per)
    if name.endswith(".self_attn.sinks"):  # gpt-oss: one sink logit per query head
        per = cfg.num_attention_heads // tp
        return t[rank * per:(rank + 1) * per]
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        lo, hi = kv_head_range(cfg.num_key_value_heads, tp, rank)
        return _rows(t, lo * D, hi * D)
    if ".mlp.experts." in name or ".mlp.shared_experts." in name:
        return _expert_tensor(name, t, cfg.moe, tp, rank)
    per_i = cfg.intermediate_size // tp
    if any(f".{c}." in name for c in COLUMN):
        return _rows(t, rank * per_i, (rank + 1) * per_i)
    if name.endswith(".self_attn.o_proj.weight"):
        per = cfg.num_attention_heads // tp * getattr(cfg, "v_head_dim", D)
        return t[:, rank * per:(rank + 1) * per]
    if name.endswith(DOWN):
        return t[:, rank * per_i:(rank + 1) * per_i]
    if ".mamba." in name:
        return _mamba_tensor(name, t, cfg, tp, rank)
    return t


def _expert_tensor(name: str, t: torch.Tensor, moe: Any, tp: int, rank: int) -> torch.Tensor:
    """An expert or shared-expert tensor's slice of the intermediate dimension (module docstring)."""
    if ".shared_experts." in name:
        per = t.shape[0 if ".down_proj." not in name else 1] // tp
        part = slice(rank * per, (rank + 1) * per)
        return t[:, part] if ".down_proj." in name else t[part]
    per = moe.moe_intermediate_size // tp
    lo, hi = rank * per, (rank + 1) * per
    I = moe.moe_intermediate_size
    interleaved = moe.expert_kind == "swiglu_clamp"  # gpt-oss: [E, H, 2I], gate/up columns interleaved
    if name.endswith(".gate_up_proj_bias"):
        return t[:, 2 * lo:2 * hi]
    if name.endswith(".gate_up_proj"):
        return t[:, :, 2 * lo:2 * hi] if interleaved else torch.cat([t[:, lo:hi], t[:, I + lo:I + hi]], dim=1)
    if name.endswith(".down_proj"):
        return t[:, lo:hi] if interleaved else t[:, :, lo:hi]
    return t  # down_proj_bias: whole (added on rank 0 only)


def _mamba_tensor(name: str, t: torch.Tensor, cfg: Any, tp: int, rank: int) -> torch.Tensor:
    """A Mamba2 mixer's slice: heads ``[r*H/tp, ...)`` of z, x, dt, ``dt_bias``, ``A_log``,
    ``D``, the norm and ``out_proj``'s input columns; B/C groups as KV heads (split, or the
    one group replicated)."""
    d, H = cfg.mamba_intermediate_size, cfg.mamba_n_heads
    GN = cfg.mamba_n_groups * cfg.mamba_d_state
    g0, g1 = kv_head_range(cfg.mamba_n_groups, tp, rank)
    dr, hr = d // tp, H // tp
    xs = slice(rank * dr, (rank + 1) * dr)
    bc = slice(g0 * cfg.mamba_d_state, g1 * cfg.mamba_d_state)
    if name.endswith(".out_proj.weight"):
        return t[:, xs]
    if name.endswith((".dt_bias", ".A_log", ".D")):
        return t[rank * hr:(rank + 1) * hr]
    if name.endswith(".norm.weight"):
        return t[xs]
    if ".in_proj." in name:  # rows: z | x | B | C | dt
        z, x, b, c, dt = t.split([d, d, GN, GN, H])
        return torch.cat([z[xs], x[xs], b[bc], c[bc], dt[rank * hr:(rank + 1) * hr]])
    if ".conv1d." in name:  # channels: x | B | C
        x, b, c = t.split([d, GN, GN])
        return torch.cat([x[xs], b[bc], c[bc]])
    return t  # out_proj.bias: whole, added after the all-reduce


def shard_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: Any, tp: int,
                     rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of a full HF ``*ForCausalLM`` state dict (same keys; views or
    copies of the full tensors, see the module docstring). ``cfg`` is the *full* config.
    Load it into the rank model with its ``load_hf_state_dict`` (strict: a wrong slice
    shape is a ``WeightLoadError``)."""
    if not 0 <= rank < tp:
        raise ParallelConfigError(f"rank {rank} outside tensor-parallel size {tp}")
    return {k: shard_tensor(k, v, cfg, tp, rank) for k, v in state_dict.items()}
