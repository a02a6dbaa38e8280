"""Without processes: a mixture-of-experts block split over tp ranks on its intermediate
dimension (router whole) gives, summed over the ranks, the whole block's output — for the
SwiGLU experts with shared experts (DeepSeek layout, Qwen3-MoE's) and for gpt-oss's
interleaved, biased, clamped experts (down bias on rank 0 only); and a Qwen3-MoE config
whose expert width does not split is refused naming the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug.runner.models import resolve_model_config
from attnplug.runner.models.moe import MoEBlock
from attnplug.runner.models.moe_config import MoEConfig
from attnplug.runner.parallel.sharding import shard_config, shard_tensor
from attnplug.runner.parallel.state import ParallelConfigError

PREFIX = "model.layers.0.mlp."
DEEPSEEK_LIKE = MoEConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                          scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, n_group=4,
                          topk_group=2, routed_scaling_factor=2.5, num_shared_experts=2, router_fp32=True)
GPT_OSS_LIKE = MoEConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                         topk_method="topk_softmax", expert_kind="swiglu_clamp", expert_bias=True, router_bias=True,
                         router_name="router")
QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 16}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("moe", [DEEPSEEK_LIKE, GPT_OSS_LIKE], ids=["swiglu+shared", "gpt-oss"])
def test_rank_partial_sums_add_up_to_the_whole_block(moe, tp):
    full = MoEBlock(moe, torch.float32, "cpu")
    full.init_weights(torch.Generator().manual_seed(0), 0.3)
    with torch.no_grad():
        for name, p in full.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape) * 0.2)
    cfg = type("Cfg", (), {"moe": moe, "head_size": 8, "intermediate_size": 64})()  # sharding reads these
    rank_moe = dataclasses.replace(moe, moe_intermediate_size=moe.moe_intermediate_size // tp)
    x = torch.randn(40, moe.hidden_size)
    total = torch.zeros_like(x)
    for rank in range(tp):
        part = MoEBlock(rank_moe, torch.float32, "cpu")
        part.experts.add_down_bias = rank == 0
        part.load_state_dict({k: shard_tensor(PREFIX + k, v, cfg, tp, rank) for k, v in full.state_dict().items()})
        with torch.no_grad():
            total += part(x)
    with torch.no_grad():
        torch.testing.assert_close(total, full(x), atol=1e-5, rtol=1e-5)


def test_qwen3_moe_rank_config_and_refused_split():
    cfg = resolve_model_config(QWEN3_MOE)
    rank_cfg = shard_config(cfg, 2)
    assert rank_cfg.moe.moe_intermediate_size == 8 and rank_cfg.moe.num_experts == 4
    assert (rank_cfg.num_attention_heads, rank_cfg.intermediate_size) == (2, 32)
    with pytest.raises(ParallelConfigError, match="moe_intermediate_size 12 is not a multiple of 8"):
        shard_config(resolve_model_config({**QWEN3_MOE, "moe_intermediate_size": 12, "intermediate_size": 64,
                                           "num_attention_heads": 8, "num_key_value_heads": 8}), 8)
