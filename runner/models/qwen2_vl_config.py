"""``Qwen2VLModelConfig``: the normalized facts of an HF Qwen2-VL config (``model_type``
``qwen2_vl``, ``Qwen2VLForConditionalGeneration``).

The language model is Qwen2 (q/k/v bias, SwiGLU, RMSNorm) with M-RoPE: the rotary
half-dimensions split into ``mrope_section`` (temporal, height, width) sections, each rotated by
its own position row (``runner/step/mrope.py`` computes the rows). The vision tower
(``vision_config``) is a ViT over ``patch_size x patch_size x temporal_patch_size`` patches with
2-D rotary positions and a patch merger that folds ``spatial_merge_size**2`` patches into one
language-model token. transformers >= 5 nests the text fields in ``text_config``; older configs
keep them at the top level: both are read. Absent fields take transformers' Qwen2-VL defaults
(``rms_norm_eps`` 1e-5, ``rope_theta`` 1e6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from attnplug.runner.models.config import DecoderModelConfig, ModelConfigError, parse_rope


@dataclass(frozen=True)
class Qwen2VLVisionConfig:
    """The vision tower (HF ``Qwen2VLVisionConfig``).

    Attributes:
        depth: vision blocks.
        embed_dim: the tower's width; ``num_heads`` heads of ``embed_dim // num_heads``.
        hidden_size: the language model's width (the merger's output).
        mlp_ratio: vision MLP width ``int(embed_dim * mlp_ratio)``.
        in_channels, patch_size, temporal_patch_size: one patch is
            ``in_channels * temporal_patch_size * patch_size**2`` pixel values (:attr:`patch_dim`).
        spatial_merge_size: ``m``: ``m x m`` patches become one language-model token.
        rope_theta: base of the 2-D vision rotary.
        hidden_act: the vision MLP's activation (``quick_gelu`` in every released config).
    """

    depth: int
    embed_dim: int
    hidden_size: int
    num_heads: int
    mlp_ratio: float
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    rope_theta: float = 10000.0
    hidden_act: str = "quick_gelu"

    @property
    def patch_dim(self) -> int:
        """Pixel values per patch: ``in_channels * temporal_patch_size * patch_size**2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


@dataclass(frozen=True)
class Qwen2VLModelConfig(DecoderModelConfig):
    """A Qwen2 language model with M-RoPE plus the vision tower.

    Attributes:
        mrope_section: ``(t, h, w)`` rotary half-dimensions per position row; sums to
            ``head_size // 2``.
        vision: the :class:`Qwen2VLVisionConfig`.
        image_token_id: the placeholder token of an image's span in a prompt.
    """

    mrope_section: tuple[int, int, int] = (16, 24, 24)
    vision: Qwen2VLVisionConfig | None = None
    image_token_id: int = 151655


def _vision(v: Mapping[str, Any], text_hidden: int) -> Qwen2VLVisionConfig:
    rope = v.get("rope_parameters") or {}
    out = Qwen2VLVisionConfig(
        depth=int(v.get("depth", 32)), embed_dim=int(v.get("embed_dim", 1280)),
        hidden_size=int(v.get("hidden_size", text_hidden)), num_heads=int(v.get("num_heads", 16)),
        mlp_ratio=float(v.get("mlp_ratio", 4)), in_channels=int(v.get("in_channels", 3)),
        patch_size=int(v.get("patch_size", 14)), temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)), rope_theta=float(rope.get("rope_theta", 10000.0)),
        hidden_act=str(v.get("hidden_act", "quick_gelu")))
    if out.hidden_size != text_hidden:
        raise ModelConfigError(f"vision_config.hidden_size {out.hidden_size} must equal the language model's "
                               f"hidden_size {text_hidden} (the merger's output replaces token embeddings)")
    if out.embed_dim % out.num_heads or (out.embed_dim // out.num_heads) % 4:
        raise ModelConfigError(f"vision_config: embed_dim {out.embed_dim} / num_heads {out.num_heads} must be a "
                               "head size divisible by 4 (2-D rotary)")
    if out.hidden_act not in ("quick_gelu", "gelu"):
        raise ModelConfigError(f"vision_config.hidden_act {out.hidden_act!r} is not supported (quick_gelu, gelu)")
    return out


def parse_qwen2_vl_config(cfg: Mapping[str, Any]) -> Qwen2VLModelConfig:
    """Normalize a ``qwen2_vl`` config dict.

    Raises:
        ModelConfigError: missing text fields, an ``mrope_section`` that is not three ints
            summing to ``head_size // 2``, a vision width that is not the text width.
    """
    text = dict(cfg.get("text_config") or cfg)
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if text.get(k) is None]
    if missing:
        raise ModelConfigError(f"qwen2_vl config lacks {missing}: a config.json of the model is needed")
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.get("mrope_section")
    if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":  # M-RoPE over default frequencies
        rope.pop("type", None)
        rope["rope_type"] = "default"
    rope.setdefault("rope_theta", text.get("rope_theta", 1_000_000.0))  # transformers' Qwen2-VL default
    text["rope_parameters"] = rope
    theta, scaling = parse_rope(text)
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    head_size = hidden // heads
    if section is None or len(section) != 3 or sum(int(s) for s in section) != head_size // 2:
        raise ModelConfigError(f"rope_parameters.mrope_section {section!r} must be three ints summing to "
                               f"head_size // 2 = {head_size // 2}")
    layers = int(text["num_hidden_layers"])
    if text.get("use_sliding_window"):
        raise ModelConfigError("qwen2_vl with use_sliding_window is not supported")
    return Qwen2VLModelConfig(
        model_type="qwen2_vl", vocab_size=int(text["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(text["intermediate_size"]), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads), head_size=head_size,
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        qkv_bias=True, o_proj_bias=False, mlp_bias=False, sliding_windows=(None,) * layers,
        initializer_range=float(text.get("initializer_range", 0.02)), hidden_act=str(text.get("hidden_act", "silu")),
        mrope_section=tuple(int(s) for s in section), vision=_vision(cfg.get("vision_config") or {}, hidden),
        image_token_id=int(cfg.get("image_token_id", 151655)))
