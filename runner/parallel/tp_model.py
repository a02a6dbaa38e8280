"""Build one tensor-parallel rank's model: the family's model at the rank's sizes, its
row-parallel and vocabulary layers swapped for ``tp_layers``, and its shard of the weights."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from attnplug.runner.models.loader import build_model, construct_model
from attnplug.runner.models.llama import BackendForLayer
from attnplug.runner.models.registry import resolve_model_config
from attnplug.runner.parallel.sharding import shard_config, shard_state_dict
from attnplug.runner.parallel.state import ParallelState
from attnplug.runner.parallel.tp_layers import (ParallelGatedRMSNorm, ParallelLMHead, RowParallelLinear,
                                                VocabParallelEmbedding, all_reduce_sum)


def _row_parallel(old: nn.Linear, state: ParallelState, dtype, device) -> RowParallelLinear:
    return RowParallelLinear(old.in_features, old.out_features, old.bias is not None, state, dtype, device)


def parallelize(model: nn.Module, full_cfg: Any, state: ParallelState) -> nn.Module:
    """Swap ``o_proj`` / ``down_proj`` for :class:`RowParallelLinear` and the embedding / LM
    head for their vocab-parallel versions, in place (weights uninitialised: load a shard). A
    mixture-of-experts MLP keeps its modules and all-reduces its output once (``MoEBlock.reduce``;
    the experts' ``down_proj_bias`` is added on rank 0 only). A Gated DeltaNet layer's ``out_proj``
    is row-parallel too (its heads, conv channels and state are the rank's own)."""
    dtype, device = model.dtype, model.device
    for layer in model.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.o_proj = _row_parallel(layer.self_attn.o_proj, state, dtype, device)
        if hasattr(layer, "linear_attn"):  # Qwen3-Next / Qwen3.5: a Gated DeltaNet layer (heads per rank)
            layer.linear_attn.out_proj = _row_parallel(layer.linear_attn.out_proj, state, dtype, device)
        if hasattr(layer, "mamba"):  # Bamba / hybrid: the Mamba2 mixer
            mixer = layer.mamba
            mixer.out_proj = _row_parallel(mixer.out_proj, state, dtype, device)
            if full_cfg.mamba_n_groups == 1 and state.tp_size > 1:  # the norm's one group spans the ranks
                mixer.norm = ParallelGatedRMSNorm(mixer.norm.weight.numel(), full_cfg.mamba_intermediate_size,
                                                  mixer.norm.eps, state, dtype, device)
        mlp = layer.mlp if hasattr(layer, "mlp") else layer.feed_forward
        if hasattr(mlp, "experts"):  # a mixture of experts: one all-reduce of routed + shared partial sums
            mlp.reduce = lambda x, state=state: all_reduce_sum(x, state)
            mlp.experts.add_down_bias = state.tp_rank == 0
        else:
            mlp.down_proj = _row_parallel(mlp.down_proj, state, dtype, device)
    hidden = full_cfg.hidden_size
    model.model.embed_tokens = VocabParallelEmbedding(full_cfg.vocab_size, hidden, state, dtype, device)
    model.lm_head = ParallelLMHead(full_cfg.vocab_size, hidden, state, dtype, device)
    if full_cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def build_tp_model(config: Any, state: ParallelState, *, backend_for_layer: BackendForLayer | None = None,
                   dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                   block_size: int = 16, seed: int | None = 0,
                   state_dict: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """Rank ``state.tp_rank``'s model of a ``state.tp_size``-way tensor-parallel run.

    Args:
        config: as :func:`attnplug.runner.models.build_model` (an HF config of a Llama-family,
            Gemma3, Bamba, attnplug_hybrid, Qwen3-Next or Qwen3.5 model).
        state: the rank and its groups (:func:`attnplug.runner.parallel.state.init_parallel`).
        backend_for_layer: ``(layer_name, layer_cfg) -> backend``, called with the *rank's*
            layer configs (``num_heads = H/tp``, ``num_kv_heads = max(1, K/tp)``).
        dtype, device, block_size: as ``build_model``.
        seed: the random weights: the full model is initialised exactly as ``build_model``
            does with this seed (on the CPU), so every tensor-parallel size runs the same model.
        state_dict: a full HF state dict to shard instead (then ``seed`` is unused).

    Returns:
        The rank model in eval mode; ``model.config`` is the rank's config
        (``sharding.shard_config``), ``model.full_config`` the full one.

    Raises:
        ParallelConfigError: the model does not split over ``tp_size`` ranks.
        BackendUnsupportedError, WeightLoadError, ModelConfigError: as ``build_model``.
    """
    full_cfg = resolve_model_config(config)
    rank_cfg = shard_config(full_cfg, state.tp_size)
    if state_dict is None:
        state_dict = build_model(config, dtype=dtype, device="cpu", block_size=block_size, seed=seed).state_dict()
    model = construct_model(rank_cfg, dtype, device, block_size, backend_for_layer)
    parallelize(model, full_cfg, state)
    model.load_hf_state_dict(shard_state_dict(state_dict, full_cfg, state.tp_size, state.tp_rank))
    model.full_config = full_cfg
    return model.eval()
