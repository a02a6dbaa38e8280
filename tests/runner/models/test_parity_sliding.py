"""`attnplug parity` on sliding-window models: Gemma3 (interleaved sliding and global
layers) and Mistral with a window, under chunked prefill and forced preemption.

Windows are not multiples of the block size and prompts are longer than the window, so
the block pool frees blocks mid-request, the runner nulls them in its table, and the
backend must read exactly the live window. HF eager recomputes each sequence from
scratch, so any key read outside (or missing inside) the window shows up in the logits.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from attnplug.runner.models import Gemma3ModelConfig, ModelConfigError, build_model, resolve_model_config
from attnplug.runner.commands.parity import run_parity

WINDOW, BLOCK = 7, 4
PROMPTS = (3, 40)
TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.1}
GEMMA3 = {**TINY, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 4,
          "num_key_value_heads": 2, "head_dim": 16, "sliding_window": WINDOW,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
          "query_pre_attn_scalar": 24, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
GEMMA3_SOFTCAP = {**GEMMA3, "final_logit_softcapping": 4.0, "attn_logit_softcapping": 3.0,
                  "layer_types": None, "sliding_window_pattern": 2, "tie_word_embeddings": False}
MISTRAL = {**TINY, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "num_hidden_layers": 2,
           "num_key_value_heads": 1, "head_dim": 16, "sliding_window": WINDOW}
CONFIGS = {"gemma3": GEMMA3, "gemma3-softcap": GEMMA3_SOFTCAP, "mistral-window": MISTRAL}


@pytest.mark.parametrize("name, force_preemption", [
    ("gemma3", False), ("gemma3", True), ("gemma3-softcap", True), ("mistral-window", False),
    ("mistral-window", True)], ids=lambda v: v if isinstance(v, str) else ("chunked+preempt" if v else "chunked"))
def test_sliding_window_parity_with_hf(name, force_preemption):
    seed = 2
    lengths = np.random.default_rng(seed).integers(PROMPTS[0], PROMPTS[1] + 1, size=5)
    assert WINDOW % BLOCK and (lengths > 2 * WINDOW).sum() >= 2, "prompts must outgrow the window"
    res = run_parity(CONFIGS[name], num_requests=5, seed=seed, force_preemption=force_preemption,
                     max_num_batched_tokens=16, max_tokens=5, block_size=BLOCK, prompt_len_range=PROMPTS)
    assert res.ok, res.line()
    assert res.num_identical == res.num_requests == 5 and res.max_abs_dlogit <= res.tolerance
    if force_preemption:
        assert res.preemptions > 0, "forced preemption did not preempt anything"


# --- Gemma3 config and model facts --------------------------------------------------------
def test_gemma3_layer_kinds_rope_and_specs():
    cfg = resolve_model_config(GEMMA3_SOFTCAP)
    assert isinstance(cfg, Gemma3ModelConfig)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2  # every 2nd layer global
    assert cfg.sliding_windows == (WINDOW, None, WINDOW, None)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert cfg.attention_scale == pytest.approx(24 ** -0.5) and cfg.attn_logit_softcapping == 3.0
    model = build_model(GEMMA3_SOFTCAP, block_size=BLOCK)
    specs = model.kv_cache_specs(BLOCK)
    assert [getattr(s, "sliding_window", None) for s in specs.values()] == list(cfg.sliding_windows)
    layers = model.layer_configs(BLOCK)
    # transformers' Gemma3 stores attn_logit_softcapping but never applies it; parity above proves we match
    assert all(c.logits_soft_cap is None for c in layers.values())
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_gemma3_reads_transformers5_rope_parameters():
    cfg = resolve_model_config({**GEMMA3, "rope_theta": None, "rope_local_base_freq": None, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert (cfg.rope_theta, cfg.rope_scaling.rope_type, cfg.rope_scaling.factor, cfg.rope_local_theta) == \
        (1e6, "linear", 8.0, 1e4)
    assert resolve_model_config({**GEMMA3, "layer_types": None}).sliding_windows == (WINDOW,) * 4  # pattern 6


@pytest.mark.parametrize("change, match", [
    ({"use_bidirectional_attention": True}, "bidirectional"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"sliding_window": None}, "sliding_window is null"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "sliding layers"),
])
def test_gemma3_bad_configs_are_clear_errors(change, match):
    with pytest.raises(ModelConfigError, match=match):
        resolve_model_config({**GEMMA3, **change})
