"""Cascade attention end to end: with prefix caching, requests of a step share their first
blocks; the runner computes ``common_prefix_len`` per group, decides per step
(runner/execute/cascade.py), and every backend that declares ``supports_cascade`` gives the
same tokens and logits as with cascade off, with a shared prefix longer and shorter than
the threshold. Backends that do not declare it say why."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.backends.emulators.backends import FlashAttn3EmulatedBackend
from attnplug.backends.flashinfer.backend import FlashInferBackend
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.backends.triton.backend import TritonBackend
from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
from attnplug.runner.execute.cascade import CascadeConfig, common_prefix_len
from attnplug.runner.execute.model_runner import ModelRunner, RunnerConfig
from attnplug.runner.models import build_model
from attnplug.runner.serve.engine import LLMEngine
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
from attnplug.runner.step.scheduler_output import SamplingParams

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 64,
         "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.1}
B = 16
SYSTEM = np.random.default_rng(5).integers(0, 97, size=40).tolist()  # 2 full blocks + 8 tokens


def _run(backend, cascade: CascadeConfig):
    model = build_model(LLAMA, backend_for_layer=lambda name, cfg: backend, block_size=B, seed=3)
    groups = group_layers_by_spec(model.kv_cache_specs(B))
    kv = KVCacheConfig(48, groups)
    runner = ModelRunner(model, kv, [backend] * len(groups), RunnerConfig(6, 128, 64), record_logits=True,
                         cascade=cascade)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=6, max_model_len=128,
                                      enable_prefix_caching=True), kv)
    engine = LLMEngine(sched, runner)
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    engine.add_request("first", SYSTEM + [1, 2, 3], sp)
    engine.step()  # computes the system prompt: its full blocks are cached
    for i in range(3):
        engine.add_request(f"r{i}", SYSTEM + [10 + i] * (3 + 2 * i), sp)
    res = engine.run()
    return runner, {k: (r.output_token_ids, torch.stack(r.logits)) for k, r in res.items()}


@pytest.mark.parametrize("backend, threshold", [
    (TorchNativeBackend, 16), (TorchNativeBackend, 64), (FlashAttn3EmulatedBackend, 16)],
    ids=["torch_native-prefix-above-threshold", "torch_native-prefix-below-threshold",
         "flash_attn3-emulated-prefix-above-threshold"])
def test_cascade_on_equals_cascade_off(backend, threshold):
    on_runner, on = _run(backend, CascadeConfig(min_prefix_len=threshold, min_num_reqs=2))
    off_runner, off = _run(backend, CascadeConfig(enabled=False))
    assert off_runner.cascade.num_cascade_steps == 0
    if threshold <= 32:  # the shared prefix: two full 16-token blocks
        assert on_runner.cascade.num_cascade_steps >= 2
    else:
        assert on_runner.cascade.num_cascade_steps == 0
    assert on.keys() == off.keys() and len(on) == 4
    for rid in on:
        assert on[rid][0] == off[rid][0], rid
        torch.testing.assert_close(on[rid][1], off[rid][1], atol=2e-4, rtol=1e-4)


def test_the_decision_names_the_reason():
    runner, _ = _run(TorchNativeBackend, CascadeConfig(min_prefix_len=16, min_num_reqs=5))
    assert runner.cascade.num_cascade_steps == 0
    assert any(r.endswith("< min_num_reqs 5") for r in runner.cascade.reason_counts), runner.cascade.reason_counts
    assert TritonBackend.get_builder_cls().supports_cascade  # tests/backends/triton/test_cascade_triton.py
    assert "MultiLevelCascadeAttentionWrapper" in FlashInferBackend.get_builder_cls().cascade_unsupported_reason


def test_common_prefix_len_counts_identical_real_leading_blocks_clamped_to_the_shortest_context():
    bt = np.array([[3, 4, 5, 9], [3, 4, 6, 0], [3, 4, 5, 7]])
    nb = np.array([4, 3, 4])
    assert common_prefix_len(bt, nb, np.array([40, 40, 40]), 16, 16) == 32
    assert common_prefix_len(bt, nb, np.array([40, 20, 40]), 16, 16) == 16  # clamp, then round down
    assert common_prefix_len(bt, nb, np.array([40, 20, 40]), 16, 4) == 20  # rounded to the kernel block
    assert common_prefix_len(np.array([[0, 4], [0, 4]]), np.array([2, 2]), np.array([32, 32]), 16, 16) == 0
    assert common_prefix_len(bt[:, :0], nb * 0, np.array([5, 5, 5]), 16, 16) == 0
