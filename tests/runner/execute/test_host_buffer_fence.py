"""The runner's host-buffer fence: each step waits for the previous step's host-to-device
input copies before rewriting the pinned host buffers (CUDA only; a stand-in fence records
the order on the CPU)."""

from __future__ import annotations

import torch

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
from attnplug.runner.serve.engine import LLMEngine
from attnplug.runner.execute.model_runner import HostBufferFence, ModelRunner, RunnerConfig
from attnplug.runner.models.presets import make_preset_model
from attnplug.runner.execute.sampler import SamplingParams
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig


class RecordingFence:
    def __init__(self, log):
        self.log = log

    def mark(self):
        self.log.append("mark")

    def wait(self):
        self.log.append("wait")


def test_each_step_waits_before_rewriting_and_marks_after_queuing_its_copies():
    model = make_preset_model(backend_for_layer=lambda name, cfg: TorchNativeBackend, block_size=16)
    kv = KVCacheConfig(32, group_layers_by_spec(model.kv_cache_specs(16)))
    runner = ModelRunner(model, kv, [TorchNativeBackend] * len(kv.groups), RunnerConfig(4, 128, 16))
    assert runner.host_buffer_fence is None, "no fence on the CPU: host and device buffers are one"
    log = []
    runner.host_buffer_fence = RecordingFence(log)
    update, build = runner.compiler.update_states, runner.metadata_builder.build
    runner.compiler.update_states = lambda so: (log.append("update_states"), update(so))[1]
    runner.metadata_builder.build = lambda *a, **k: (log.append("build"), build(*a, **k))[1]
    engine = LLMEngine(Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128), kv),
                       runner)
    # a 40-token prompt in 16-token chunks: the first steps sample nothing (no device sync)
    engine.add_request("r0", list(range(1, 41)), SamplingParams(temperature=0.0, max_tokens=2))
    engine.run()
    steps = [log[i:i + 4] for i in range(0, len(log), 4)]
    # 3 prefill chunks and a decode each build and mark; the last output (the request finished,
    # nothing scheduled) only waits and applies its deltas
    assert steps[:-1] == [["wait", "update_states", "build", "mark"]] * 4, log
    assert steps[-1] == ["wait", "update_states"], log


def test_the_cuda_fence_waits_only_once_marked(monkeypatch):
    calls = []

    class FakeEvent:
        def record(self):
            calls.append("record")

        def synchronize(self):
            calls.append("synchronize")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    fence = HostBufferFence()
    fence.wait()  # nothing queued yet: no wait
    fence.mark()
    fence.wait()
    assert calls == ["record", "synchronize"]
