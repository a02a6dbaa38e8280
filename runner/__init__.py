"""attnplug.runner: the step compiler, the model runner and the engine around them.

One step (``docs/architecture.md``; embedding it in your own engine: ``docs/embedding.md``):

1. check: ``StepCompiler.update_states`` validates the ``SchedulerOutput`` (``runner/step/check*.py``)
2. apply: then merges its deltas into the request state and batch rows (``runner/step/apply.py``)
3. prepare: ``prepare_inputs`` flattens the rows into tokens, positions, slots (``runner/step/prepare.py``)
4. common metadata: one ``CommonAttentionMetadata`` per cache group (``runner/step/common_metadata.py``)
5. build: each group's backend builder lowers it (``runner/execute/group_metadata.py``)
6. forward: the model runs; each attention layer calls its backend impl (``backends/<name>/impl.py``)
7. sample: logits at ``logits_indices``, discarded rows dropped (``runner/execute/sampler.py``)
8. append: ``append_output_tokens`` adds the samples to the history (``runner/step/append.py``)

``ModelRunner`` does 1-8 per ``execute_model``; ``LLMEngine`` loops ``Scheduler.schedule``
→ ``execute_model`` → ``Scheduler.update_from_output``. The names below are imported
lazily (PEP 562), so ``import attnplug.runner`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # the step compiler and what flows through it
    "StepCompiler": "attnplug.runner.step.compiler",
    "StepInputs": "attnplug.runner.step.prepare",
    "SchedulerOutput": "attnplug.runner.step.scheduler_output",
    "NewRequestData": "attnplug.runner.step.scheduler_output",
    "CachedRequestData": "attnplug.runner.step.scheduler_output",
    "SamplingParams": "attnplug.runner.step.scheduler_output",
    "PackedCachedDeltas": "attnplug.runner.step.scheduler_output",
    "pack_cached_deltas": "attnplug.runner.step.packed_deltas",
    "PromptEmbedsConfig": "attnplug.runner.step.prompt_embeds",
    "PlaceholderRange": "attnplug.runner.step.mrope",
    "MultiModalConfig": "attnplug.runner.step.multimodal",
    "MultiModalFeature": "attnplug.runner.step.multimodal",
    "MMSlice": "attnplug.runner.step.multimodal",
    "image_feature": "attnplug.runner.step.multimodal",
    # executing steps
    "ModelRunner": "attnplug.runner.execute.model_runner",
    "ModelRunnerOutput": "attnplug.runner.execute.model_runner",
    "RunnerConfig": "attnplug.runner.execute.model_runner",
    "negotiate_kernel_block_sizes": "attnplug.runner.execute.kv_caches",
    "kernel_kv_cache_spec": "attnplug.runner.execute.kv_caches",
    "allocate_kv_caches": "attnplug.runner.execute.kv_caches",
    # serving
    "LLMEngine": "attnplug.runner.serve.engine",
    "Scheduler": "attnplug.runner.serve.scheduler",
    "SchedulerConfig": "attnplug.runner.serve.scheduler",
    # KV-cache configuration
    "KVCacheConfig": "attnplug.cache_groups.grouping",
    "KVCacheGroupSpec": "attnplug.cache_groups.grouping",
    "group_layers_by_spec": "attnplug.cache_groups.grouping",
    "KVCacheSpec": "attnplug.cache_groups.specs",
    "AttentionSpec": "attnplug.cache_groups.specs",
    "FullAttentionSpec": "attnplug.cache_groups.specs",
    "SlidingWindowSpec": "attnplug.cache_groups.specs",
    "MambaSpec": "attnplug.cache_groups.specs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'attnplug.runner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
