"""Every decoder config names each size field that is not a positive int (the shared
``DecoderSizes.SIZE_FIELDS`` check, ``runner/models/config.py``), in one message per field."""

from __future__ import annotations

import dataclasses

import pytest

from attnplug.runner.models import ModelConfigError
from attnplug.runner.models.config import positive_int_problems
from attnplug.runner.models.registry import resolve_model_config

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_size")
CONFIGS = {
    "llama": {**TINY, "model_type": "llama"},
    "bamba": {**TINY, "model_type": "bamba", "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 16,
              "mamba_d_state": 8, "mamba_chunk_size": 8},
    "gemma3_text": {**TINY, "model_type": "gemma3_text", "head_dim": 8, "sliding_window": 4},
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("field", SIZES)
def test_a_non_positive_size_is_named(family, field):
    cfg = resolve_model_config(CONFIGS[family])
    with pytest.raises(ModelConfigError, match=f"{field} must be a positive int, got 0"):
        dataclasses.replace(cfg, **{field: 0})


def test_positive_int_problems_lists_each_bad_field_in_order():
    class Sizes:
        a, b, c, d, e = 3, 0, -1, 2.0, True

    assert positive_int_problems(Sizes, "abcde") == [
        "b must be a positive int, got 0", "c must be a positive int, got -1", "d must be a positive int, got 2.0",
        "e must be a positive int, got True"]
    assert positive_int_problems(Sizes, "ae", bool_ok=True) == []
