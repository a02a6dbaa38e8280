"""The ModelRunner with ``cudagraph_mode="full"`` on CUDA over flash_attn / flashinfer /
triton: graphs are captured and replayed, and greedy tokens equal the eager runner's; with
asynchronous scheduling too (the previous step's tokens patched into the graph's input
buffer on the device)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")]


def _generate(backend, mode, prompts, block_size, max_tokens=8, async_scheduling=False):
    from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
    from attnplug.runner.serve.engine import LLMEngine
    from attnplug.runner.execute.model_runner import ModelRunner, RunnerConfig
    from attnplug.runner.models.presets import make_preset_model
    from attnplug.runner.execute.sampler import SamplingParams
    from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig

    model = make_preset_model(backend_for_layer=lambda name, cfg: backend, block_size=block_size,
                              dtype=torch.float16, device="cuda")
    groups = group_layers_by_spec(model.kv_cache_specs(block_size))
    kv = KVCacheConfig(64, groups)
    runner = ModelRunner(model, kv, [backend] * len(groups), RunnerConfig(8, 1024, 128), device="cuda",
                         cudagraph_mode=mode, record_logits=True)
    engine = LLMEngine(Scheduler(SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8, max_model_len=1024,
                                                 async_scheduling=async_scheduling), kv), runner)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return runner, {k: (r.output_token_ids, r.logits) for k, r in engine.run().items()}


def assert_same_greedy_run(got, want, atol=3e-2):
    """Graph and eager runs pad differently, so fp16 sums may round differently: every step's
    logits must agree within ``atol`` until the tokens part, and they may part only at a
    near tie (the eager top-2 logits closer than ``2 * atol``)."""
    assert got.keys() == want.keys()
    for rid in want:
        (g_tokens, g_logits), (w_tokens, w_logits) = got[rid], want[rid]
        for step, (gt, wt) in enumerate(zip(g_tokens, w_tokens)):
            torch.testing.assert_close(g_logits[step], w_logits[step], atol=atol, rtol=0)
            if gt != wt:
                top2 = w_logits[step].topk(2).values
                assert float(top2[0] - top2[1]) < 2 * atol, (rid, step, gt, wt, top2)
                break
        else:
            assert g_tokens == w_tokens, rid


@pytest.mark.parametrize("name", ["flash_attn", "flashinfer", "triton"])
def test_runner_with_graphs_generates_the_eager_tokens(name):
    from attnplug.plugins import get_backend

    backend = get_backend(name)
    ok, why = backend.is_available()
    if not ok:
        pytest.skip(f"requires {name}: {why}")
    block_size = 256 if backend.get_supported_kernel_block_size(16) is None else 16
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 2000, (n,), generator=g).tolist() for n in (5, 40, 3, 77, 12)]
    runner, got = _generate(backend, "full", prompts, block_size)
    assert runner.cudagraphs.decision.capture, runner.cudagraphs.decision.reason
    assert runner.cudagraphs.graphs.num_captures > 0 and runner.cudagraphs.graphs.num_replays > 0
    _, want = _generate(backend, None, prompts, block_size)
    assert_same_greedy_run(got, want)


def test_async_runner_with_graphs_generates_the_sync_eager_tokens():
    """Asynchronous scheduling and full CUDA graphs together (triton): each step's
    ``input_ids`` take the previous step's tokens on the device (``placeholders.
    patch_input_ids``) in the buffer the graphs read; tokens and logits equal the
    synchronous eager run's."""
    from attnplug.plugins import get_backend

    backend = get_backend("triton")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 2000, (n,), generator=g).tolist() for n in (5, 40, 3, 77, 12, 9)]
    runner, got = _generate(backend, "full", prompts, 16, max_tokens=10, async_scheduling=True)
    assert runner.cudagraphs.graphs.num_replays > 0
    _, want = _generate(backend, None, prompts, 16, max_tokens=10)
    assert_same_greedy_run(got, want)
