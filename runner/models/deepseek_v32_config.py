"""``DeepseekV32ModelConfig``: DeepSeek-V3.2 = DeepSeek-V3 + the sparse-attention indexer.

Read from an HF ``DeepseekV32Config`` dict (transformers 5.x names): every DeepSeek-V3 field
(``deepseek_config.parse_deepseek_config``; the MLA RoPE always pairs interleaved, as HF's
V3.2 does) plus ``index_n_heads``, ``index_head_dim`` and ``index_topk``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from attnplug.runner.models.config import ModelConfigError, positive_int_problems
from attnplug.runner.models.deepseek_config import DeepseekModelConfig, parse_deepseek_config

INDEX_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")


@dataclass(frozen=True)
class DeepseekV32ModelConfig(DeepseekModelConfig):
    """DeepSeek-V3 plus the indexer: ``index_n_heads`` heads of ``index_head_dim``, keeping
    ``index_topk`` tokens per query; ``q_lora_rank`` is required (the indexer reads ``q_resid``)."""

    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048

    def __post_init__(self):
        super().__post_init__()
        bad = positive_int_problems(self, INDEX_FIELDS)
        if not bad and self.index_head_dim < self.qk_rope_head_dim:
            bad.append(f"index_head_dim {self.index_head_dim} < qk_rope_head_dim {self.qk_rope_head_dim} (the "
                       "indexer rotates its first qk_rope_head_dim dimensions)")
        if self.q_lora_rank is None:
            bad.append("q_lora_rank must be set (the indexer's queries come from q_a_layernorm)")
        if bad:
            raise ModelConfigError(f"invalid {self.model_type} config: " + "; ".join(bad) + ". Fix the config.json values.")


def parse_deepseek_v32_config(cfg: Mapping[str, Any]) -> DeepseekV32ModelConfig:
    """The :class:`DeepseekV32ModelConfig` of an HF ``DeepseekV32Config`` dict.

    Raises:
        ModelConfigError: what :func:`parse_deepseek_config` raises, a missing indexer field,
            or an inconsistent one (named).
    """
    missing = [k for k in INDEX_FIELDS if cfg.get(k) is None]
    if missing:
        raise ModelConfigError(f"deepseek_v32 config lacks {missing}: a config.json of the model is needed")
    base = parse_deepseek_config(cfg, "deepseek_v32")
    return DeepseekV32ModelConfig(**{f.name: getattr(base, f.name) for f in fields(base)},
                                  **{k: cfg[k] for k in INDEX_FIELDS})


__all__ = ["INDEX_FIELDS", "DeepseekV32ModelConfig", "parse_deepseek_v32_config"]
