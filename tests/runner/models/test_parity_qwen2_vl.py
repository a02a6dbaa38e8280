"""`attnplug parity` on a tiny random Qwen2-VL (vision tower + M-RoPE language model): greedy
tokens identical to HF ``Qwen2VLForConditionalGeneration``, fp32, for requests with one and two
random images, under chunked prefill that cuts image spans, forced preemption and prefix caching;
the encoder cache encodes each image once per prefill; prefix caching hits the blocks of a
request that repeats an image and misses from the first image block of one with a new image."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attnplug.runner.commands.parity import main as parity_main  # noqa: E402
from attnplug.runner.commands.parity import run_parity  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from parity_runs import QWEN2_VL as CONFIG  # noqa: E402
from parity_runs import assert_parity  # noqa: E402

OPTIONS = {"chunked": {}, "preempt": {"force_preemption": True}, "prefix": {"prefix_caching": True}}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_qwen2_vl_parity_with_hf(option):
    # 4 requests: 1, 2, 1, 2 images (prefix: two groups of three, same tokens, same / new image)
    num_requests = 6 if option == "prefix" else 4
    res = run_parity(CONFIG, num_requests=num_requests, seed=0, max_num_batched_tokens=8, max_tokens=4, block_size=4,
                     **OPTIONS[option])
    assert_parity(res, option, num_requests, max_abs_dlogit=1e-4)


def test_parity_cli_on_a_qwen2_vl_config(tmp_path, capsys):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert parity_main(["--hf-config", str(path), "--num-requests", "2", "--max-tokens", "3",
                        "--max-num-batched-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("parity: OK tokens 2/2 identical")
