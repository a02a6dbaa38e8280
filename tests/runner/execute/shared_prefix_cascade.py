"""What the cascade end-to-end tests share (``test_cascade_runner.py``, and the Triton one in
``tests/backends/triton/test_cascade_triton.py``): an engine run with prefix caching in which
a first request caches a system prompt of two full 16-token blocks + 8 tokens and the next
requests share it, and the check that cascade on gives cascade off's tokens and logits.
Imported by path: ``sys.path.insert(0, <this folder>)``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
from attnplug.runner.execute.cascade import CascadeConfig
from attnplug.runner.execute.model_runner import ModelRunner, RunnerConfig
from attnplug.runner.models import build_model
from attnplug.runner.serve.engine import LLMEngine
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
from attnplug.runner.step.scheduler_output import SamplingParams

B = 16
SYSTEM = np.random.default_rng(5).integers(0, 97, size=40).tolist()  # 2 full blocks + 8 tokens


@dataclass(frozen=True)
class SharedPrefixRun:
    """A tiny random Llama (vocab 97, hidden 64, 4 / 2 heads) served greedily, block size 16."""

    num_layers: int
    max_position_embeddings: int
    num_blocks: int
    """KV-cache blocks per group."""
    max_num_reqs: int
    max_model_len: int
    max_tokens: int
    """Greedy tokens per request."""
    num_sharing: int
    """Requests that share the cached system prompt (after the first, which caches it)."""

    def llama(self) -> dict:
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 64,
                "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_hidden_layers": self.num_layers, "max_position_embeddings": self.max_position_embeddings,
                "rms_norm_eps": 1e-6, "initializer_range": 0.1}

    def run(self, backend, cascade: CascadeConfig) -> tuple[ModelRunner, dict[str, tuple[list[int], torch.Tensor]]]:
        """The runner and ``{request id: (output token ids, [num_tokens, vocab] logits)}``."""
        model = build_model(self.llama(), backend_for_layer=lambda name, cfg: backend, block_size=B, seed=3)
        groups = group_layers_by_spec(model.kv_cache_specs(B))
        kv = KVCacheConfig(self.num_blocks, groups)
        runner = ModelRunner(model, kv, [backend] * len(groups), RunnerConfig(self.max_num_reqs, self.max_model_len, 64),
                             record_logits=True, cascade=cascade)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=self.max_num_reqs,
                                          max_model_len=self.max_model_len, enable_prefix_caching=True), kv)
        engine = LLMEngine(sched, runner)
        sp = SamplingParams(temperature=0.0, max_tokens=self.max_tokens)
        engine.add_request("first", SYSTEM + [1, 2, 3], sp)
        engine.step()  # computes the system prompt: its full blocks are cached
        for i in range(self.num_sharing):
            engine.add_request(f"r{i}", SYSTEM + [10 + i] * (3 + 2 * i), sp)
        res = engine.run()
        return runner, {rid: (r.output_token_ids, torch.stack(r.logits)) for rid, r in res.items()}


def assert_cascade_on_equals_off(run: SharedPrefixRun, backend, threshold: int) -> None:
    """Cascade on (prefix of at least ``threshold`` tokens, two requests) cascades exactly when
    the shared two blocks reach the threshold, and gives cascade off's tokens and logits."""
    on_runner, on = run.run(backend, CascadeConfig(min_prefix_len=threshold, min_num_reqs=2))
    off_runner, off = run.run(backend, CascadeConfig(enabled=False))
    assert off_runner.cascade.num_cascade_steps == 0
    if threshold <= 32:  # the shared prefix: two full 16-token blocks
        assert on_runner.cascade.num_cascade_steps >= 2
    else:
        assert on_runner.cascade.num_cascade_steps == 0
    assert on.keys() == off.keys() and len(on) == run.num_sharing + 1
    for rid in on:
        assert on[rid][0] == off[rid][0], rid
        torch.testing.assert_close(on[rid][1], off[rid][1], atol=2e-4, rtol=1e-4)
