"""`attnplug parity` on tiny random Qwen3-Next (GDN + gated attention + MoE) and Qwen3.5 text
(GDN + gated attention, dense) vs HF's torch path, fp32.

HF recomputes every sequence from scratch; our engine carries each GDN layer's conv and
recurrent states across chunked-prefill steps in per-request slots, drops them on
preemption, restores block-boundary checkpoints on prefix-cache hits.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from attnplug.runner.commands.parity import run_parity

BASE = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 2, "max_position_embeddings": 256,
        "initializer_range": 0.1, "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5}
QWEN3_NEXT = dict(BASE, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                  norm_topk_prob=True)
QWEN3_5 = dict(BASE, model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"])
MODES = {"chunked": {}, "preempt": {"force_preemption": True}, "prefix": {"prefix_caching": True},
         "async": {"async_scheduling": True}}
DEFAULT = {("qwen3_next", "preempt"), ("qwen3_next", "prefix"), ("qwen3_5", "async"), ("qwen3_5", "prefix")}


def _cases():
    for family, cfg in (("qwen3_next", QWEN3_NEXT), ("qwen3_5", QWEN3_5)):
        for mode in MODES:
            marks = () if (family, mode) in DEFAULT else (pytest.mark.slow,)
            yield pytest.param(cfg, mode, id=f"{family}-{mode}", marks=marks)


@pytest.mark.parametrize("cfg,mode", list(_cases()))
def test_gdn_hybrid_parity_with_hf(cfg, mode):
    res = run_parity(cfg, num_requests=4, seed=1, max_num_batched_tokens=16, max_tokens=5, block_size=4,
                     prompt_len_range=(1, 30), **MODES[mode])
    assert res.ok, res.line()
    assert res.num_identical == res.num_requests == 4 and res.max_abs_dlogit <= res.tolerance
    if mode == "preempt":
        assert res.preemptions > 0, "forced preemption did not preempt anything"
    if mode == "prefix":
        assert "prefix-hit tokens" in res.line() and " 0 prefix-hit" not in res.line(), res.line()


def test_layer_kinds_come_from_the_config():
    from attnplug.runner.models import resolve_model_config
    from attnplug.runner.models.config import ModelConfigError

    assert resolve_model_config(QWEN3_5).layer_types == ("linear_attention", "full_attention") * 2
    explicit = dict(QWEN3_5, layer_types=["full_attention"] + ["linear_attention"] * 3)
    assert resolve_model_config(explicit).layer_types[0] == "full_attention"
    default = {k: v for k, v in QWEN3_5.items() if k != "full_attention_interval"}
    assert resolve_model_config(dict(default, num_hidden_layers=8)).layer_types.count("full_attention") == 2
    no_factor = {k: v for k, v in QWEN3_5.items() if k != "partial_rotary_factor"}
    assert resolve_model_config(no_factor).rope_scaling.partial_rotary_factor == 0.25, "transformers' default"
    with pytest.raises(ModelConfigError, match="layer_types"):
        resolve_model_config(dict(QWEN3_5, layer_types=["mamba"] * 4))
    with pytest.raises(ModelConfigError, match="linear_num_value_heads 3 is not a multiple"):
        resolve_model_config(dict(QWEN3_5, linear_num_value_heads=3))


def test_tensor_parallel_is_refused_in_one_line_until_gdn_layers_shard():
    from attnplug.runner.models import resolve_model_config
    from attnplug.runner.parallel.sharding import check_shardable
    from attnplug.runner.parallel.state import ParallelConfigError

    check_shardable(resolve_model_config(QWEN3_NEXT), 1)
    with pytest.raises(ParallelConfigError, match="qwen3_next .Gated DeltaNet layers, gated attention. has no "
                                                  "tensor-parallel sharding yet"):
        check_shardable(resolve_model_config(QWEN3_NEXT), 2)


def test_speculative_decoding_on_gdn_groups_is_refused_naming_the_backend():
    from attnplug.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--speculative: state backend\(s\) of group .*gdn_torch.* do not verify"):
        run_parity(QWEN3_5, num_requests=1, seed=1, max_tokens=2, block_size=4, prompt_len_range=(4, 6),
                   speculative="ngram:k=2")
