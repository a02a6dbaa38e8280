"""``Qwen3Model``: HF ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` over pluggable backends.

The Llama family's model (``llama.DecoderModel``) with two changes, under HF's names::

    model.layers.N.self_attn.{q,k}_norm        RMSNorm over head_size, applied per head
                                               before RoPE (the rank's heads under TP)
    model.layers.N.mlp                         SwiGLU (dense layers) or ``moe.MoEBlock``:
                                               mlp.gate.weight [E, H],
                                               mlp.experts.gate_up_proj [E, 2I, H],
                                               mlp.experts.down_proj [E, H, I]

Numerics follow transformers 5.24's ``Qwen3Attention`` / ``Qwen3MoeSparseMoeBlock``
(facts, not code): the q/k norms are ``Qwen3RMSNorm`` (float32 statistic, ``weight * x``);
the router is softmax, top-k, renormalised when ``norm_topk_prob`` (see ``moe.py``).
Layer names, cache groups and windows are the Llama family's.
"""

from __future__ import annotations

import torch
from torch import nn

from attnplug.core.contracts import AttentionBackend
from attnplug.runner.models.layers import Attention, RMSNorm, SwiGLUMLP
from attnplug.runner.models.llama import DecoderBody, DecoderLayer, DecoderModel, attention_layer_name
from attnplug.runner.models.moe import MoEBlock
from attnplug.runner.models.qwen3_config import Qwen3ModelConfig
from attnplug.runner.models.weights import init_hf_style
from attnplug.runner.models.rope import RotaryEmbedding


class Qwen3Attention(Attention):
    """:class:`~attnplug.runner.models.layers.Attention` with per-head q/k RMSNorm before RoPE."""

    def __init__(self, cfg: Qwen3ModelConfig, index: int, rope: RotaryEmbedding,
                 backend: type[AttentionBackend], dtype: torch.dtype, device):
        super().__init__(attention_layer_name(index), cfg.hidden_size, cfg.num_attention_heads,
                         cfg.num_key_value_heads, cfg.head_size, rope, backend, cfg.qkv_bias, cfg.o_proj_bias,
                         cfg.sliding_windows[index], dtype, device)
        self.q_norm = RMSNorm(cfg.head_size, cfg.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(cfg.head_size, cfg.rms_norm_eps, dtype, device)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of every query and key head (``[num_tokens, heads, head_size]``)."""
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(DecoderLayer):
    """Pre-norm block ``h += attn(norm(h)); h += mlp(norm(h))`` whose MLP is the mixture of
    experts on sparse layers."""

    def __init__(self, cfg: Qwen3ModelConfig, index: int, rope: RotaryEmbedding,
                 backend: type[AttentionBackend], dtype: torch.dtype, device):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Qwen3Attention(cfg, index, rope, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = (MoEBlock(cfg.moe, dtype, device) if cfg.sparse_layers[index]
                    else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device))


class Qwen3Body(DecoderBody):
    """HF's ``Qwen3Model`` / ``Qwen3MoeModel`` (the ``model.`` prefix)."""

    layer_cls = Qwen3DecoderLayer


class Qwen3Model(DecoderModel):
    """A Qwen3 or Qwen3-MoE causal LM whose attention runs through pluggable backends.

    Same interface as :class:`~attnplug.runner.models.llama.DecoderModel` (``forward``,
    ``compute_logits``, ``kv_cache_specs``, ``layer_configs``, ``load_hf_state_dict``).
    """

    body_cls = Qwen3Body

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float | None = None) -> None:
        """HF-style random init: weights (expert tensors included) ``N(0, std)``, biases and the
        routers' correction biases 0, every norm 1.

        Args:
            seed: seeds a private CPU generator (reproducible on any device); ``None`` uses
                the global RNG.
            std: standard deviation (default: the config's ``initializer_range``).
        """
        init_hf_style(self, seed, self.config.initializer_range if std is None else std)


__all__ = ["Qwen3Attention", "Qwen3DecoderLayer", "Qwen3Model"]
