"""``Qwen3ModelConfig``: HF ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` configs, normalized.

A Qwen3 model is a Llama-family decoder (``DecoderModelConfig``'s fields) plus an RMSNorm
over each query and key head before RoPE; ``attention_bias`` puts biases on q/k/v *and* o.
Qwen3-MoE replaces the MLP of its sparse layers by a mixture of experts
(:class:`~attnplug.runner.models.moe_config.MoEConfig`): layer ``i`` is sparse unless it is in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; dense layers keep a SwiGLU MLP
of ``intermediate_size``.

Windows: Qwen3 as Qwen2 (``layer_types``, else ``use_sliding_window`` from layer
``max_window_layers`` on); Qwen3-MoE's transformers model applies ``sliding_window`` to every
layer when ``use_sliding_window`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from attnplug.runner.models.config import DecoderModelConfig, ModelConfigError
from attnplug.runner.models.moe_config import MoEConfig, parse_moe, sparse_layers

QWEN3_TYPES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Qwen3ModelConfig(DecoderModelConfig):
    """A Qwen3 (dense) or Qwen3-MoE decoder.

    Attributes (beyond :class:`DecoderModelConfig`'s):
        moe: the mixture-of-experts MLP of the sparse layers; ``None`` for dense Qwen3.
        sparse_layers: per layer, ``True`` where the MLP is ``moe`` (all ``False`` when dense).
    """

    moe: MoEConfig | None = None
    sparse_layers: tuple[bool, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        if len(self.sparse_layers) != self.num_hidden_layers:
            raise ModelConfigError(f"invalid {self.model_type} config: {len(self.sparse_layers)} sparse-layer flags "
                                   f"for {self.num_hidden_layers} layers")
        if any(self.sparse_layers) and self.moe is None:
            raise ModelConfigError(f"invalid {self.model_type} config: sparse layers without a mixture of experts")


def qwen3_extras(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The :class:`Qwen3ModelConfig` fields beyond the Llama family's, from the config dict.

    Raises:
        ModelConfigError: an invalid MoE field (named), ``num_experts`` 0 with sparse layers
            requested, or ``mlp_only_layers`` / ``decoder_sparse_step`` out of range.
    """
    if model_type == "qwen3":
        return {"moe": None, "sparse_layers": (False,) * num_layers}
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if num_experts == 0:  # transformers: no expert -> every layer dense
        return {"moe": None, "sparse_layers": (False,) * num_layers}
    sparse = sparse_layers(num_layers, mlp_only_layers=cfg.get("mlp_only_layers") or (),
                           decoder_sparse_step=cfg.get("decoder_sparse_step", 1))
    return {"moe": parse_moe(cfg, model_type), "sparse_layers": sparse}


__all__ = ["QWEN3_TYPES", "Qwen3ModelConfig", "qwen3_extras"]
