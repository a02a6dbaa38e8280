"""`attnplug parity --prefix-caching`: greedy tokens and logits equal HF transformers with
prefix-cache hits (shared system prompts and multi-turn continuations,
runner/commands/shared_prefixes.py) on Llama and on Gemma3, whose sliding window (7) is
shorter than the shared prefixes (24 tokens), so hits carry null blocks before the window;
under forced preemption (resumed requests hit their own freed blocks; Llama with
asynchronous scheduling); and on
Bamba (Mamba2 + attention), whose hits restore a state checkpoint saved at a multiple of
the Mamba block size (a shared prefix ending mid-block hits the previous boundary)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from attnplug.runner.commands.parity import run_parity

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.1}
LLAMA = {**TINY, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2,
         "num_hidden_layers": 2}
GEMMA3 = {**TINY, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2,
          "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 7,
          "layer_types": ["sliding_attention", "full_attention"],
          "query_pre_attn_scalar": 24, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}


BAMBA = {"model_type": "bamba", "architectures": ["BambaForCausalLM"], "vocab_size": 128, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_n_groups": 2,
         "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8, "max_position_embeddings": 256,
         "initializer_range": 0.1, "rms_norm_eps": 1e-5}


@pytest.mark.parametrize("name, async_scheduling", [("llama", True), ("gemma3", False), ("bamba", False)],
                         ids=["llama-async", "gemma3", "bamba"])
def test_prefix_hits_match_hf_under_preemption(name, async_scheduling):
    cfg = {"llama": LLAMA, "gemma3": GEMMA3, "bamba": BAMBA}[name]
    res = run_parity(cfg, num_requests=6, seed=1, force_preemption=True, max_num_batched_tokens=16,
                     max_tokens=5, block_size=4, prompt_len_range=(10, 50), prefix_caching=True,
                     async_scheduling=async_scheduling)
    assert res.ok, res.line()
    assert res.prefix_cache_hit_requests >= 3 and res.prefix_cache_hits >= 48, res.line()
    assert res.preemptions > 0
