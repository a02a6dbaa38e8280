"""`attnplug parity` on gpt-oss (alternating sliding / full layers, per-head attention sinks,
a mixture of clamped, biased experts on every layer, YaRN RoPE): greedy tokens identical to HF
transformers' ``GptOssForCausalLM``, fp32, under chunked prefill, forced preemption, prefix
caching and n-gram speculative decoding; and selection refuses a backend without sinks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from attnplug.core.errors import BackendUnsupportedError  # noqa: E402
from attnplug.runner.commands.parity import run_parity  # noqa: E402
from attnplug.runner.models import build_model, resolve_model_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from parity_runs import assert_parity, options  # noqa: E402

GPT_OSS = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 128, "hidden_size": 64,
           "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "initializer_range": 0.1,
           "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "num_local_experts": 4,
           "num_experts_per_tok": 2, "swiglu_limit": 7.0,
           "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 10000.0}}
OPTIONS = options("chunked", "preempt", "prefix", "ngram")


@pytest.mark.parametrize("option", list(OPTIONS))
def test_gpt_oss_parity_with_hf(option):
    res = run_parity(GPT_OSS, num_requests=4, seed=1, max_num_batched_tokens=16, max_tokens=5, block_size=4,
                     prompt_len_range=(3, 30), **OPTIONS[option])
    assert_parity(res, option, 4)


def test_gpt_oss_layers_have_windows_and_sinks():
    cfg = resolve_model_config(GPT_OSS)
    assert cfg.sliding_windows == (8, None) and cfg.rope_scaling.rope_type == "yarn"
    model = build_model(GPT_OSS)
    layer_cfgs = list(model.layer_configs(4).values())
    assert [c.sliding_window for c in layer_cfgs] == [8, None] and all(c.has_sinks for c in layer_cfgs)
    attn = model.model.layers[0].self_attn
    assert attn.sinks.dtype.is_floating_point and attn.impl.sinks.data_ptr() == attn.sinks.data_ptr()


def test_a_backend_without_sinks_is_refused_with_every_reason():
    from attnplug.backends.emulators import FlashAttn3EmulatedBackend

    with pytest.raises(BackendUnsupportedError, match="attention sinks"):
        build_model(GPT_OSS, backend_for_layer=lambda name, cfg: FlashAttn3EmulatedBackend)
