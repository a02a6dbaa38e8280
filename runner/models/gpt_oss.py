"""``GptOssModel``: HF ``GptOssForCausalLM`` over pluggable backends.

The Llama family's model (``llama.DecoderModel``) with gpt-oss's changes, under HF's names::

    model.layers.N.self_attn.{q,k,v,o}_proj     nn.Linear with bias
    model.layers.N.self_attn.sinks              [num_attention_heads] sink logits (float32 here)
    model.layers.N.mlp.router.{weight,bias}     [E, H], [E]
    model.layers.N.mlp.experts.gate_up_proj     [E, H, 2I] (+ _bias [E, 2I]), gate/up interleaved
    model.layers.N.mlp.experts.down_proj        [E, I, H] (+ _bias [E, H])

Numerics follow transformers 5.x ``modeling_gpt_oss.py`` (facts, not code): the sink is one
more logit per head in the softmax denominator and carries no value (the attention
contract's ``sinks``, ``core/contracts.AttentionImpl``); sliding layers see
``sliding_window`` tokens; the experts are ``moe.py``'s ``swiglu_clamp``; RMSNorm in float32
(HF multiplies the weight before the cast back; identical in float32); YaRN RoPE
(``rope.py``). Each attention layer's :class:`~attnplug.core.contracts.AttentionLayerConfig`
has ``has_sinks=True``, so selection only picks a backend that declares ``supports_sink()``.
"""

from __future__ import annotations

import torch
from torch import nn

from attnplug.core.contracts import AttentionBackend, AttentionLayerConfig, AttentionType
from attnplug.runner.models.gpt_oss_config import GptOssModelConfig
from attnplug.runner.models.layers import Attention, RMSNorm
from attnplug.runner.models.llama import DecoderBody, DecoderLayer, DecoderModel, attention_layer_name
from attnplug.runner.models.moe import MoEBlock
from attnplug.runner.models.rope import RotaryEmbedding
from attnplug.runner.models.weights import init_hf_style


def gpt_oss_layer_configs(cfg: GptOssModelConfig, dtype: torch.dtype, device: torch.device | str,
                          block_size: int) -> dict[str, AttentionLayerConfig]:
    """``{layer_name: AttentionLayerConfig}`` in model order: the layer's window, and sinks on every layer."""
    return {
        attention_layer_name(i): AttentionLayerConfig(
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_size=cfg.head_size,
            dtype=dtype, block_size=block_size, sliding_window=window, attn_type=AttentionType.DECODER,
            device=torch.device(device).type, has_sinks=True)
        for i, window in enumerate(cfg.sliding_windows)
    }


class GptOssAttention(Attention):
    """:class:`~attnplug.runner.models.layers.Attention` with per-head sinks handed to the impl.

    ``sinks`` is a float32 parameter (``[num_heads]``); the impl gets a detached view of the
    same storage, so loading weights (an in-place copy) reaches it.
    """

    def __init__(self, cfg: GptOssModelConfig, index: int, rope: RotaryEmbedding,
                 backend: type[AttentionBackend], dtype: torch.dtype, device):
        super().__init__(attention_layer_name(index), cfg.hidden_size, cfg.num_attention_heads,
                         cfg.num_key_value_heads, cfg.head_size, rope, backend, cfg.qkv_bias, cfg.o_proj_bias,
                         cfg.sliding_windows[index], dtype, device, sinks=True)


class GptOssDecoderLayer(DecoderLayer):
    """Pre-norm block ``h += attn(norm(h)); h += moe(norm(h))``."""

    def __init__(self, cfg: GptOssModelConfig, index: int, rope: RotaryEmbedding,
                 backend: type[AttentionBackend], dtype: torch.dtype, device):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = GptOssAttention(cfg, index, rope, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MoEBlock(cfg.moe, dtype, device)


class GptOssBody(DecoderBody):
    """HF's ``GptOssModel`` (the ``model.`` prefix)."""

    layer_cls = GptOssDecoderLayer


class GptOssModel(DecoderModel):
    """A gpt-oss causal LM whose attention runs through pluggable backends (interface of
    :class:`~attnplug.runner.models.llama.DecoderModel`)."""

    body_cls = GptOssBody

    def layer_configs(self, block_size: int) -> dict[str, AttentionLayerConfig]:
        """See :func:`gpt_oss_layer_configs`."""
        return gpt_oss_layer_configs(self.config, self.dtype, self.device, block_size)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float | None = None) -> None:
        """HF-style random init (``weights.init_hf_style``): weights, expert tensors and sinks
        ``N(0, std)``, biases 0, norms 1."""
        init_hf_style(self, seed, self.config.initializer_range if std is None else std)


__all__ = ["GptOssAttention", "GptOssDecoderLayer", "GptOssModel", "gpt_oss_layer_configs"]
