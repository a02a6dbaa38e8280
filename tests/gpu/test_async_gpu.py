"""Asynchronous scheduling on CUDA: a steady-state step synchronises nothing with the host
(``torch.cuda.set_sync_debug_mode("error")`` around launching it), and the outputs equal
the synchronous engine's."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")]


def _engine(async_scheduling: bool):
    from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
    from attnplug.plugins import get_backend
    from attnplug.runner.execute.model_runner import ModelRunner, RunnerConfig
    from attnplug.runner.models.presets import make_preset_model
    from attnplug.runner.serve.engine import LLMEngine
    from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig

    backend = get_backend("triton")  # torch_native's builder synchronises by design (its write rows: nonzero)
    model = make_preset_model(backend_for_layer=lambda name, cfg: backend, block_size=16, dtype=torch.float16,
                              device="cuda")
    groups = group_layers_by_spec(model.kv_cache_specs(16))
    kv = KVCacheConfig(64, groups)
    runner = ModelRunner(model, kv, [backend] * len(groups), RunnerConfig(8, 1024, 128), device="cuda")
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8, max_model_len=1024,
                                      async_scheduling=async_scheduling), kv)
    return LLMEngine(sched, runner)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_steady_async_step_does_not_synchronise(sampling):
    """Greedy, and seeded sampling with temperature, top-k and top-p (the sampler's per-row
    parameters and noise go up through pinned copies: cache_groups/buffers.upload)."""
    from attnplug.runner.step.scheduler_output import SamplingParams

    prompts = [[(7 * i + j) % 100 + 1 for j in range(5 + i)] for i in range(4)]
    params = [SamplingParams(max_tokens=12) if sampling == "greedy" else
              SamplingParams(temperature=0.8, top_k=20 + i, top_p=0.9, seed=100 + i, max_tokens=12)
              for i in range(len(prompts))]
    outs = {}
    for mode in (False, True):
        eng = _engine(mode)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params[i])
        for _ in range(4):  # prefills done, decoding, one step in flight
            eng.step()
        if mode:
            out = eng.scheduler.schedule()
            torch.cuda.set_sync_debug_mode("error")
            try:
                handle = eng.runner.execute_model_async(out)  # launches a steady step
            finally:
                torch.cuda.set_sync_debug_mode("default")
            prev_out, prev = eng._in_flight
            eng._apply(prev_out, prev.result())
            eng._in_flight = (out, handle)
            eng.stats.num_steps += 1
        outs[mode] = {k: r.output_token_ids for k, r in eng.run().items()}
    assert outs[True] == outs[False]
