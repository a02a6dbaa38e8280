"""``DeepseekModelConfig``: DeepSeek-V2 / V3 (multi-head latent attention + MoE), normalized.

Read from an HF ``DeepseekV2Config`` / ``DeepseekV3Config`` dict (transformers 5.24 names):
``q_lora_rank`` (``None``: a plain ``q_proj``, DeepSeek-V2-Lite), ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``first_k_dense_replace`` (dense
SwiGLU layers before the MoE ones), the MoE fields (``moe_config.parse_moe``) and the RoPE
(``config.parse_rope``; YaRN with ``mscale_all_dim`` also scales the softmax). V2 always
pairs RoPE dimensions ``(2i, 2i + 1)`` (complex rotation); V3 does when ``rope_interleave``
(default true).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from attnplug.core.mla import mla_dim_problems
from attnplug.runner.models.config import DecoderModelConfig, ModelConfigError, parse_rope
from attnplug.runner.models.moe_config import MoEConfig, parse_moe, sparse_layers

DEEPSEEK_TYPES: dict[str, str] = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


@dataclass(frozen=True)
class DeepseekModelConfig(DecoderModelConfig):
    """A DeepSeek-V2/V3 decoder. ``head_size`` is ``qk_nope_head_dim + qk_rope_head_dim``;
    ``num_key_value_heads == num_attention_heads`` (MLA has no KV-head sharing to declare)."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attention_bias: bool = False
    moe: MoEConfig | None = None
    sparse_layers: tuple[bool, ...] = ()

    def _rope_problems(self) -> list[str]:
        """DeepSeek rotates only the ``qk_rope_head_dim`` part, interleaved or not (HF's
        ``rope_interleave``): nothing of :class:`RopeScaling` is refused here."""
        return []

    def __post_init__(self):
        problems = mla_dim_problems({"num_heads": self.num_attention_heads, "kv_lora_rank": self.kv_lora_rank,
                                     "qk_nope_head_dim": self.qk_nope_head_dim,
                                     "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
                                     "q_lora_rank": self.q_lora_rank, "head_dim": self.head_size})
        if problems:
            raise ModelConfigError(f"invalid {self.model_type} config: " + "; ".join(problems)
                                   + ". Fix the config.json values.")
        super().__post_init__()
        if len(self.sparse_layers) != self.num_hidden_layers or (any(self.sparse_layers) and self.moe is None):
            raise ModelConfigError(f"invalid {self.model_type} config: sparse-layer flags {self.sparse_layers} do not "
                                   f"fit {self.num_hidden_layers} layers and the MoE fields")


def parse_deepseek_config(cfg: Mapping[str, Any], model_type: str) -> DeepseekModelConfig:
    """The :class:`DeepseekModelConfig` of an HF config dict.

    Raises:
        ModelConfigError: a missing field, inconsistent MLA dimensions (each field named),
            an MoE field out of range, unsupported RoPE scaling.
    """
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ModelConfigError(f"{model_type} config lacks {missing}: a config.json of the model is needed")
    num_layers = int(cfg["num_hidden_layers"])
    theta, scaling = parse_rope(cfg)
    v3 = model_type == "deepseek_v3"
    interleaved = bool(cfg.get("rope_interleave", True)) if v3 else True
    if scaling.interleaved != interleaved:
        scaling = replace(scaling, interleaved=interleaved)
    n_experts = cfg.get("n_routed_experts")
    first_dense = cfg.get("first_k_dense_replace", 0)
    sparse = (False,) * num_layers if not n_experts else sparse_layers(
        num_layers, first_k_dense_replace=first_dense, decoder_sparse_step=cfg.get("moe_layer_freq", 1))
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    return DeepseekModelConfig(
        model_type=model_type, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=num_layers,
        num_attention_heads=int(cfg["num_attention_heads"]), num_key_value_heads=int(cfg["num_attention_heads"]),
        head_size=nope + rope if isinstance(nope, int) and isinstance(rope, int) else 0,  # HF's head_dim is R
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=False, o_proj_bias=False,
        mlp_bias=bool(cfg.get("mlp_bias", False)), sliding_windows=(None,) * num_layers,
        initializer_range=float(cfg.get("initializer_range", 0.02)), hidden_act=str(cfg.get("hidden_act", "silu")),
        q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=cfg["v_head_dim"], attention_bias=bool(cfg.get("attention_bias", False)),
        moe=parse_moe(cfg, model_type) if any(sparse) else None, sparse_layers=sparse)


__all__ = ["DEEPSEEK_TYPES", "DeepseekModelConfig", "parse_deepseek_config"]
