"""``Qwen2VLModel``: Qwen2-VL (vision tower + Qwen2 language model with M-RoPE) over a paged
KV cache.

Module tree and parameter names match HF ``Qwen2VLForConditionalGeneration`` (transformers 5)::

    model.visual.*                              the vision tower (``qwen2_vl_vision.py``)
    model.language_model.embed_tokens / layers.N.* / norm     as Qwen2 (``llama.py``)
    lm_head

The language model is :class:`~attnplug.runner.models.llama.DecoderModel`'s blocks with one
change: the rotary takes ``[3, num_tokens]`` positions (temporal, height, width rows;
``StepInputs.mrope_positions``, ``runner/step/mrope.py``) and rotates the half-dimensions of
``mrope_section[i]`` by row ``i`` (transformers' M-RoPE: the ``i``-th section of the frequency
axis takes row ``i``). Images never enter :meth:`forward`: :meth:`embed_image` encodes one
image into the rows that replace its placeholder tokens, and the runner passes them as
``inputs_embeds`` / ``is_embed`` (its encoder cache, ``runner/execute/encoder_cache.py``).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from attnplug.core.contracts import AttentionBackend
from attnplug.core.devices import resolve_device
from attnplug.runner.models.layers import lookup_layer, lookup_metadata, merge_embeds
from attnplug.runner.models.llama import DecoderBody, DecoderModel
from attnplug.runner.models.qwen2_vl_config import Qwen2VLModelConfig
from attnplug.runner.models.qwen2_vl_vision import VisionTower
from attnplug.runner.models.rope import RotaryEmbedding
from attnplug.runner.models.weights import init_hf_style


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE over three position rows (M-RoPE); a ``[T]`` position vector is used for all three."""

    def __init__(self, head_size, theta, scaling, device, mrope_section: tuple[int, int, int]):
        super().__init__(head_size, theta, scaling, device)
        self.mrope_section = list(mrope_section)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[3, T]`` (or ``[T]``) int64 -> ``cos``, ``sin`` ``[T, 1, head_size // 2]``."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        angles = positions.float().unsqueeze(-1) * self.inv_freq  # [3, T, half]
        angles = torch.cat([part[i] for i, part in enumerate(angles.split(self.mrope_section, dim=-1))], dim=-1)
        return angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)


class _LanguageModel(DecoderBody):
    """HF's ``Qwen2VLTextModel``: Qwen2 blocks sharing one :class:`MRotaryEmbedding`."""

    def __init__(self, cfg: Qwen2VLModelConfig, backends, dtype, device):
        super().__init__(cfg, backends, dtype, device)
        rope = MRotaryEmbedding(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, device, cfg.mrope_section)
        for layer in self.layers:
            layer.self_attn.rope = rope


class Qwen2VLModel(DecoderModel):
    """Qwen2-VL whose attention runs through pluggable backends.

    Attributes:
        uses_mrope: ``True``: ``forward`` takes ``[3, num_tokens]`` positions (the runner
            builds its step compiler with ``uses_mrope``).
        config: the :class:`Qwen2VLModelConfig`.
    """

    uses_mrope = True

    def __init__(self, cfg: Qwen2VLModelConfig, backends: list[type[AttentionBackend]],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        nn.Module.__init__(self)
        self.config, self.dtype, self.device = cfg, dtype, resolve_device(device)
        self.model = nn.Module()
        self.model.visual = VisionTower(cfg.vision, dtype, device)
        self.model.language_model = _LanguageModel(cfg, backends, dtype, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight
        self.layer_names = [layer.self_attn.layer_name for layer in self.model.language_model.layers]

    @property
    def attention_layers(self):
        return {layer.self_attn.layer_name: layer.self_attn for layer in self.model.language_model.layers}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Mapping[str, object], kv_caches: Mapping[str, torch.Tensor], *,
                inputs_embeds: torch.Tensor | None = None, is_embed: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`DecoderModel.forward`, with ``positions`` ``[3, num_tokens]`` int64 (M-RoPE
        rows; ``[num_tokens]`` means all three equal). ``inputs_embeds`` / ``is_embed`` carry
        the image rows (and prompt embeddings)."""
        lm = self.model.language_model
        hidden = merge_embeds(lm.embed_tokens(input_ids), inputs_embeds, is_embed)
        for layer in lm.layers:
            name = layer.self_attn.layer_name
            hidden = layer(hidden, positions, lookup_layer(kv_caches, name, "kv_caches"),
                           lookup_metadata(attn_metadata, name))
        return lm.norm(hidden)

    def embed_image(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's placeholder rows: ``pixel_values`` ``[t * H * W, patch_dim]``, patch grid
        ``(t, H, W)`` -> ``[t * H * W / spatial_merge_size^2, hidden_size]`` model dtype."""
        return self.model.visual(pixel_values.to(self.device, self.dtype), grid_thw)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float | None = None) -> None:
        """HF-style random init (``weights.init_hf_style``), LayerNorm biases 0 and weights 1."""
        init_hf_style(self, seed, self.config.initializer_range if std is None else std)
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
