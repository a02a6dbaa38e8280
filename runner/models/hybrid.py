"""``attnplug_hybrid``: Bamba's layout with full-attention, sliding-window and Mamba2 layers.

No HF architecture mixes all three layer kinds, yet that is the case a hybrid runner must
serve: three kinds of cache group in one step (paged K/V kept whole, paged K/V freed
behind a window, one state slot per request). This family is a Bamba model
(``bamba.BambaModel``: same blocks, parameter names and numerics) in which the attention
layers listed in ``sliding_attn_layer_indices`` attend over a window of
``sliding_window`` tokens. It backs the bundled default preset of ``attnplug run``
(random weights; there is no HF checkpoint to compare with, so no parity).

Config: every ``BambaConfig`` field, plus ``sliding_window`` (W, tokens, current
included) and ``sliding_attn_layer_indices`` (a subset of ``attn_layer_indices``);
``model_type = "attnplug_hybrid"``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from attnplug.cache_groups.specs import KVCacheSpec, SlidingWindowSpec
from attnplug.core.contracts import AttentionBackend, AttentionLayerConfig, AttentionType
from attnplug.core.mamba import MambaLayerConfig
from attnplug.runner.models.bamba import BambaModel, bamba_layer_configs
from attnplug.runner.models.bamba_config import BambaModelConfig, parse_bamba_config
from attnplug.runner.models.config import ModelConfigError
from attnplug.runner.models.llama import attention_layer_name
from attnplug.runner.models.impls import make_impl


@dataclass(frozen=True)
class HybridModelConfig(BambaModelConfig):
    """A :class:`BambaModelConfig` whose attention layers ``sliding_attn_layer_indices``
    use a ``sliding_window``-token window."""

    sliding_window: int | None = None
    sliding_attn_layer_indices: tuple[int, ...] = ()

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Per layer ``W`` for sliding-window attention layers, ``None`` otherwise."""
        slide = set(self.sliding_attn_layer_indices)
        return tuple(self.sliding_window if i in slide else None for i in range(self.num_hidden_layers))

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Per layer ``"full_attention"``, ``"sliding_attention"`` or ``"mamba"``."""
        slide = set(self.sliding_attn_layer_indices)
        return tuple("sliding_attention" if i in slide else t for i, t in enumerate(self.layer_types))

    def __post_init__(self):
        super().__post_init__()
        stray = sorted(set(self.sliding_attn_layer_indices) - set(self.attn_layer_indices))
        if stray:
            raise ModelConfigError(f"sliding_attn_layer_indices {stray} are not attention layers "
                                   f"(attn_layer_indices {list(self.attn_layer_indices)})")
        w = self.sliding_window
        if self.sliding_attn_layer_indices and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
            raise ModelConfigError(f"sliding_window must be a positive int for the sliding layers, got {w!r}")


def parse_hybrid_config(cfg: Mapping[str, Any]) -> HybridModelConfig:
    """Normalize an ``attnplug_hybrid`` config dict (Bamba fields + the window fields).

    Raises:
        ModelConfigError: what :func:`parse_bamba_config` rejects, sliding layers that are
            not attention layers, or a missing / non-positive window.
    """
    base = parse_bamba_config(cfg)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(BambaModelConfig)}
    fields["model_type"] = "attnplug_hybrid"
    window = cfg.get("sliding_window")
    return HybridModelConfig(**fields, sliding_window=None if window is None else int(window),
                             sliding_attn_layer_indices=tuple(sorted(int(i) for i in
                                                                     cfg.get("sliding_attn_layer_indices") or ())))


def hybrid_layer_configs(cfg: HybridModelConfig, dtype: torch.dtype, device: torch.device | str,
                         block_size: int) -> dict[str, AttentionLayerConfig | MambaLayerConfig]:
    """Bamba's layer configs with the window set on the sliding attention layers."""
    out = bamba_layer_configs(cfg, dtype, device, block_size)
    for i in cfg.sliding_attn_layer_indices:
        name = attention_layer_name(i)
        out[name] = dataclasses.replace(out[name], sliding_window=cfg.sliding_window)
    return out


class HybridModel(BambaModel):
    """A :class:`BambaModel` whose sliding attention layers attend over a window.

    Same constructor, step interface and HF parameter names as ``BambaModel``; the
    sliding layers' impls are created with ``sliding_window`` and their cache specs are
    :class:`SlidingWindowSpec`.
    """

    def __init__(self, cfg: HybridModelConfig, backends: list[type[AttentionBackend]],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", block_size: int = 16):
        super().__init__(cfg, backends, dtype=dtype, device=device, block_size=block_size)
        for i in cfg.sliding_attn_layer_indices:
            attn = self.model.layers[i].self_attn
            attn.sliding_window = cfg.sliding_window
            attn.impl = make_impl(
                backends[i], attn.layer_name, attn.num_heads, attn.head_size, attn.head_size ** -0.5,
                attn.num_kv_heads,
                sliding_window=cfg.sliding_window, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                kv_cache_dtype=dtype)

    def layer_configs(self, block_size: int) -> dict[str, AttentionLayerConfig | MambaLayerConfig]:
        """What each layer needs of a backend (see :func:`hybrid_layer_configs`)."""
        return hybrid_layer_configs(self.config, self.dtype, self.device, block_size)

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """``{layer_name: FullAttentionSpec | SlidingWindowSpec | MambaSpec}`` in model order."""
        specs = super().kv_cache_specs(block_size)
        for i in self.config.sliding_attn_layer_indices:
            name = attention_layer_name(i)
            s = specs[name]
            specs[name] = SlidingWindowSpec(block_size=s.block_size, num_kv_heads=s.num_kv_heads,
                                            head_size=s.head_size, dtype=s.dtype,
                                            sliding_window=self.config.sliding_window)
        return specs
