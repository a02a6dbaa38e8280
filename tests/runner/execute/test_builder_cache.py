"""Cached builder outputs: per step, groups with the same (spec, builder class) build once.

A Gemma3 model of 12 layers (6 sliding, 6 global) split into 6 cache groups of 2 layers
(``group_layers_by_spec(..., max_layers_per_group=2)``) has 2 distinct specs: every step
must do exactly 2 builds and 4 ``update_block_table`` reuses, the layers of a group must
share one metadata object, and every reused object must equal a fresh build of its own
group field by field (torch_native; triton and mamba have their own tests).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
from attnplug.runner.serve.engine import LLMEngine
from attnplug.runner.execute.model_runner import ModelRunner, RunnerConfig
from attnplug.runner.models import build_model
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
from attnplug.runner.step.scheduler_output import SamplingParams

CFG = {"model_type": "gemma3_text", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
       "num_hidden_layers": 12, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
       "sliding_window": 6, "sliding_window_pattern": 2, "max_position_embeddings": 256}
BLOCK = 4


def assert_same(a, b, path="metadata"):
    """Field-by-field equality of metadata objects (dataclasses, tuples, tensors, scalars)."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    else:
        assert a == b, path


def make_engine(enable_builder_cache=True, max_layers_per_group=2):
    model = build_model(CFG, block_size=BLOCK, seed=0)
    groups = group_layers_by_spec(model.kv_cache_specs(BLOCK), max_layers_per_group=max_layers_per_group)
    kv = KVCacheConfig(200, groups)
    cfg = RunnerConfig(max_num_reqs=4, max_model_len=96, max_num_batched_tokens=24)
    runner = ModelRunner(model, kv, [TorchNativeBackend] * len(groups), cfg,
                         enable_builder_cache=enable_builder_cache)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4, max_model_len=96,
                                      force_preemption_every=4), kv)
    engine = LLMEngine(sched, runner)
    rng = np.random.default_rng(0)
    for i, n in enumerate((30, 9, 17, 40)):
        engine.add_request(f"r{i}", rng.integers(0, 96, n).tolist(), SamplingParams(max_tokens=6))
    return engine, groups


def test_six_groups_of_two_specs_build_twice_per_step_and_reuses_equal_fresh_builds():
    engine, groups = make_engine()
    assert len(groups) == 6 and len({g.kv_cache_spec for g in groups}) == 2
    gmb = engine.runner.metadata_builder
    original = gmb.build
    seen = {"steps": 0}

    def checked_build(common, *args, **kwargs):
        per_group, per_layer = original(common, *args, **kwargs)
        assert (gmb.counters.builds, gmb.counters.reuses) == (2, 4)
        for g, (group, builder, md) in enumerate(zip(groups, gmb.builders, per_group)):
            assert all(per_layer[name] is md for name in group.layer_names)  # layers share one object
            assert_same(md, builder.build(0, common[g]), f"group {g}")      # reuse == fresh build
        assert len({id(md) for md in per_group}) == 6
        seen["steps"] += 1
        return per_group, per_layer

    gmb.build = checked_build
    results = engine.run()
    assert len(results) == 4 and seen["steps"] > 10
    assert engine.scheduler.num_preemptions > 0
    assert gmb.counters.total_builds == 2 * gmb.counters.steps
    assert gmb.counters.total_reuses == 4 * gmb.counters.steps


def test_caching_changes_no_token_and_off_builds_every_group():
    on, _ = make_engine(enable_builder_cache=True)
    off, _ = make_engine(enable_builder_cache=False)
    out_on, out_off = on.run(), off.run()
    assert {r: v.output_token_ids for r, v in out_on.items()} == {r: v.output_token_ids for r, v in out_off.items()}
    c = off.runner.metadata_builder.counters
    assert c.total_reuses == 0 and c.total_builds == 6 * c.steps


@pytest.mark.parametrize("split", [None, 1])
def test_group_layers_by_spec_split(split):
    model = build_model(CFG, block_size=BLOCK, seed=0)
    groups = group_layers_by_spec(model.kv_cache_specs(BLOCK), max_layers_per_group=split)
    assert len(groups) == (2 if split is None else 12)
    assert sum(len(g.layer_names) for g in groups) == 12
