"""`attnplug parity` on Bamba (Mamba2 + attention): chunked prefill and forced preemption vs HF.

HF's torch path (no mamba_ssm kernels) recomputes every sequence from scratch in float32;
our engine carries conv/SSM states across chunked-prefill steps in per-request slots,
drops them on preemption and recomputes.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from attnplug.runner.commands.parity import run_parity

CHUNK = 8
BAMBA = {"model_type": "bamba", "architectures": ["BambaForCausalLM"], "vocab_size": 128, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_n_groups": 2,
         "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": CHUNK, "max_position_embeddings": 256,
         "initializer_range": 0.1, "rms_norm_eps": 1e-5}
PROMPTS = (1, 30)


@pytest.mark.parametrize("force_preemption", [False, True], ids=["chunked", "chunked+preempt"])
def test_bamba_parity_with_hf(force_preemption):
    seed = 1
    lengths = np.random.default_rng(seed).integers(PROMPTS[0], PROMPTS[1] + 1, size=5)
    assert (lengths % CHUNK != 0).any() and lengths.max() > 16, "prompts must straddle chunks and steps"
    res = run_parity(BAMBA, num_requests=5, seed=seed, force_preemption=force_preemption,
                     max_num_batched_tokens=16, max_tokens=5, block_size=4, prompt_len_range=PROMPTS)
    assert res.ok, res.line()
    assert res.num_identical == res.num_requests == 5 and res.max_abs_dlogit <= res.tolerance
    if force_preemption:
        assert res.preemptions > 0, "forced preemption did not preempt anything"
