"""`attnplug parity` on tiny random Qwen3-Next (GDN + gated attention + MoE), Qwen3.5 text
(GDN + gated attention, dense) and Qwen3.5-MoE text (Qwen3.5 with the MoE and its gated shared
expert on every layer, top-k always renormalised) vs HF's torch path, fp32.

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
QWEN3_5_MOE = dict({k: v for k, v in BASE.items() if k != "intermediate_size"}, model_type="qwen3_5_moe_text",
                   architectures=["Qwen3_5MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16, shared_expert_intermediate_size=16)  # MoE on every layer
MODES = {"chunked": {}, "preempt": {"force_preemption": True}, "prefix": {"prefix_caching": True},
         "async": {"async_scheduling": True}}
DEFAULT = {("qwen3_next", "preempt"), ("qwen3_next", "prefix"), ("qwen3_5", "async"), ("qwen3_5", "prefix"),
           ("qwen3_5_moe", "preempt")}


def _cases():
    for family, cfg in (("qwen3_next", QWEN3_NEXT), ("qwen3_5", QWEN3_5), ("qwen3_5_moe", QWEN3_5_MOE)):
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
    moe = resolve_model_config(QWEN3_5_MOE)  # every layer sparse; HF's router always renormalises
    assert moe.sparse_layers == (True,) * 4 and moe.moe.norm_topk_prob and moe.gdn_layout == "qwen3_5"
    with pytest.raises(ModelConfigError, match="shared_expert_intermediate_size must be a positive int"):
        resolve_model_config({k: v for k, v in QWEN3_5_MOE.items() if k != "shared_expert_intermediate_size"})


def test_tensor_parallel_refuses_gdn_key_heads_that_do_not_split_in_one_line():
    from attnplug.runner.models import resolve_model_config
    from attnplug.runner.parallel.sharding import check_shardable, shard_config
    from attnplug.runner.parallel.state import ParallelConfigError

    rank = shard_config(resolve_model_config(QWEN3_NEXT), 2)  # TP=2 itself: tests/distributed/test_tensor_parallel.py
    assert (rank.linear_num_key_heads, rank.linear_num_value_heads, rank.shared_expert_intermediate_size) == (1, 2, 8)
    with pytest.raises(ParallelConfigError, match="linear_num_key_heads 2 is not a multiple of 4"):
        check_shardable(resolve_model_config(dict(QWEN3_5, num_attention_heads=8, num_key_value_heads=4)), 4)
    with pytest.raises(ParallelConfigError, match="shared_expert_intermediate_size 9 is not a multiple of 2"):
        check_shardable(resolve_model_config(dict(QWEN3_NEXT, shared_expert_intermediate_size=9)), 2)


SPEC_MODES = {"chunked": {}, "preempt": {"force_preemption": True}, "prefix": {"prefix_caching": True}}
SPEC_DEFAULT = {("qwen3_5", "chunked")}


def _spec_cases():
    for family, cfg in (("qwen3_next", QWEN3_NEXT), ("qwen3_5", QWEN3_5)):
        for mode in SPEC_MODES:
            marks = () if (family, mode) in SPEC_DEFAULT else (pytest.mark.slow,)
            yield pytest.param(dict(cfg, vocab_size=12, num_hidden_layers=2), mode, id=f"{family}-ngram-{mode}",
                               marks=marks)


@pytest.mark.parametrize("cfg,mode", list(_spec_cases()))
def test_gdn_hybrid_greedy_with_drafts_matches_hf(cfg, mode):
    """``--speculative ngram:k=3`` on a GDN hybrid (a 12-token vocabulary: greedy outputs
    repeat, so drafts are both accepted and rejected): every verifying row's per-draft conv
    and recurrent states land in its scratch slots and the accepted one becomes its state."""
    res = run_parity(cfg, num_requests=3, seed=1, max_num_batched_tokens=16, max_tokens=12, block_size=4,
                     prompt_len_range=(10, 24) if mode == "prefix" else (3, 16), speculative="ngram:k=3",
                     **SPEC_MODES[mode])
    assert res.ok, res.line()
    assert res.spec["accepted"] > 0, f"no draft was accepted: the state commit did not run ({res.spec})"
    assert res.spec["proposed"] > res.spec["accepted"], f"no draft was rejected ({res.spec})"
    if mode == "preempt":
        assert res.preemptions > 0, "forced preemption did not preempt anything"
    if mode == "prefix":
        assert "prefix-hit tokens" in res.line() and " 0 prefix-hit" not in res.line(), res.line()


def test_speculative_decoding_on_a_state_backend_that_does_not_verify_is_refused(monkeypatch):
    from attnplug.backends.state.gdn.backend import GDNTorchBackend
    from attnplug.core.errors import ConfigError

    monkeypatch.setattr(GDNTorchBackend, "supports_draft_verification", False)
    with pytest.raises(ConfigError, match=r"--speculative: state backend\(s\) of group .*gdn_torch.* do not verify"):
        run_parity(QWEN3_5, num_requests=1, seed=1, max_tokens=2, block_size=4, prompt_len_range=(4, 6),
                   speculative="ngram:k=2")
