"""`attnplug parity` on a tiny random Qwen2-VL (vision tower + M-RoPE language model): greedy
tokens identical to HF ``Qwen2VLForConditionalGeneration``, fp32, for requests with one and two
random images, under chunked prefill that cuts image spans, forced preemption and prefix caching;
the encoder cache encodes each image once per prefill; prefix caching hits the blocks of a
request that repeats an image and misses from the first image block of one with a new image."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from attnplug.runner.commands.parity import main as parity_main  # noqa: E402
from attnplug.runner.commands.parity import run_parity  # noqa: E402

CONFIG = {
    "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
    "text_config": {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.1,
                    "bos_token_id": 0, "eos_token_id": 1,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}},
    "vision_config": {"depth": 2, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "spatial_merge_size": 2,
                      "patch_size": 2, "temporal_patch_size": 2, "in_channels": 3, "mlp_ratio": 2,
                      "initializer_range": 0.1},
    "image_token_id": 90, "video_token_id": 91, "vision_start_token_id": 92, "vision_end_token_id": 93,
}
OPTIONS = {"chunked": {}, "preempt": {"force_preemption": True}, "prefix": {"prefix_caching": True}}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_qwen2_vl_parity_with_hf(option):
    # 4 requests: 1, 2, 1, 2 images (prefix: two groups of three, same tokens, same / new image)
    res = run_parity(CONFIG, num_requests=6 if option == "prefix" else 4, seed=0, max_num_batched_tokens=8,
                     max_tokens=4, block_size=4, **OPTIONS[option])
    assert res.ok, res.line()
    assert res.num_identical == res.num_requests and res.max_abs_dlogit <= 1e-4
    if option == "preempt":
        assert res.preemptions > 0
    if option == "prefix":
        assert res.prefix_cache_hits > 0, res.line()


def test_parity_cli_on_a_qwen2_vl_config(tmp_path, capsys):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert parity_main(["--hf-config", str(path), "--num-requests", "2", "--max-tokens", "3",
                        "--max-num-batched-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("parity: OK tokens 2/2 identical")
