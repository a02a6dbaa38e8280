"""Strict loading of HF state dicts into attnplug's models.

A leaf of ``runner.models``: it imports no model family, so every family's
``load_hf_state_dict`` method can call :func:`load_hf_state_dict` here without an import
cycle (``loader`` imports the families; the families import this module).
"""

from __future__ import annotations

import re
from typing import Mapping

import torch
from torch import nn

from attnplug.core.errors import AttnplugError


class WeightLoadError(AttnplugError, ValueError):
    """A state dict does not match the model: missing, unexpected or misshapen tensors.

    Attributes:
        missing: parameter names the model needs that the state dict lacks.
        unexpected: state-dict keys the model has no parameter for.
        mismatched: ``(name, expected_shape, given_shape)`` triples.
    """

    def __init__(self, missing: list[str], unexpected: list[str], mismatched: list[tuple[str, tuple, tuple]]):
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched

        def listing(items, limit=8):
            shown = ", ".join(map(str, items[:limit]))
            return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")

        parts = []
        if missing:
            parts.append(f"missing {len(missing)} keys: {listing(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} keys: {listing(unexpected)}")
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatches: "
                         + listing([f"{n} expects {list(e)} got {list(g)}" for n, e, g in mismatched]))
        super().__init__("state dict does not match the model: " + "; ".join(parts)
                         + ". The weights must come from an HF model of the same config "
                           "(same architecture, sizes and tie_word_embeddings). Nothing was loaded.")


WeightLoadError.__module__ = "attnplug"

IGNORED_HF_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
"""Keys some HF checkpoints carry that are recomputed here (RoPE inverse frequencies)."""


def load_hf_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy HF weights into ``model``, strictly: validate everything first, then copy.

    Args:
        model: the target: a ``DecoderModel``, ``BambaModel`` or ``Gemma3Model`` (any
            module with a ``config.tie_word_embeddings``).
        state_dict: HF ``*ForCausalLM.state_dict()`` (or a checkpoint's tensors), same
            parameter names. With tied embeddings ``lm_head.weight`` may be absent (it is
            ``model.embed_tokens.weight``) or present (then ignored). Keys matching
            :data:`IGNORED_HF_KEYS` are ignored. Tensors are cast to the model's dtype and
            device. An fp8 checkpoint's ``*.self_attn.k_scale`` / ``v_scale`` / ``q_scale``
            (``kv_scale``) are kept as ``model.attnplug_checkpoint_kv_scales``
            (``kv_scales.split_checkpoint_scales``), what ``--kv-scales checkpoint`` / ``auto``
            use.

    Raises:
        WeightLoadError: missing, unexpected, or wrongly shaped tensors (all listed); the
            model is unchanged.
    """
    from attnplug.runner.models.kv_scales import split_checkpoint_scales

    params = dict(model.named_parameters())  # tied lm_head.weight appears once, as embed_tokens
    tied = model.config.tie_word_embeddings
    given = {k: v for k, v in state_dict.items()
             if not IGNORED_HF_KEYS.search(k) and not (tied and k == "lm_head.weight")}
    given, kv_scales, scale_problems = split_checkpoint_scales(model, given)
    missing = sorted(set(params) - set(given))
    unexpected = sorted(set(given) - set(params)) + scale_problems
    mismatched = [(k, tuple(params[k].shape), tuple(given[k].shape)) for k in sorted(set(params) & set(given))
                  if tuple(params[k].shape) != tuple(given[k].shape)]
    if missing or unexpected or mismatched:
        raise WeightLoadError(missing, unexpected, mismatched)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(given[name].to(device=p.device, dtype=p.dtype))
    model.attnplug_checkpoint_kv_scales = kv_scales or None


@torch.no_grad()
def init_hf_style(model: nn.Module, seed: int | None, std: float) -> None:
    """HF-style random init of every parameter of ``model``: weights ``N(0, std)`` (drawn in
    fp32, then cast to the parameter's dtype), biases (routers' correction biases too) 0,
    every ``*norm.weight`` 1. ``seed`` seeds a private CPU generator (reproducible on any
    device); ``None`` uses the global RNG."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(("bias", "_bias")):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))


__all__ = ["IGNORED_HF_KEYS", "WeightLoadError", "init_hf_style", "load_hf_state_dict"]
