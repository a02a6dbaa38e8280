"""``ModelRunner``: one step, in order — update_states → prepare_inputs → common metadata →
per-group builders → model forward (every attention layer calls its backend impl) →
logits at ``logits_indices`` → sample → drop discarded rows.

It is a thin coordinator: the step compiler (``runner/step/compiler.py``, ``StepCompiler``)
owns the persistent batch state, ``runner/execute/group_metadata.py``
(``GroupMetadataBuilder``) the builders, ``runner/execute/kv_caches.py`` the caches, the
model its layers, ``runner/execute/sampler.py`` (``Sampler``) the draws.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from attnplug.cache_groups.buffers import upload
from attnplug.cache_groups.grouping import KVCacheConfig
from attnplug.cache_groups.kinds import GroupKind
from attnplug.core.contracts import AttentionBackend, BuilderConfig
from attnplug.core.devices import resolve_device
from attnplug.core.errors import ConfigError, MetadataError
from attnplug.runner.execute.cascade import CascadeConfig, CascadePlanner
from attnplug.runner.execute.group_metadata import GroupMetadataBuilder
from attnplug.runner.execute import kv_transfer
from attnplug.runner.execute.kv_caches import allocate_kv_caches, kernel_kv_cache_spec, negotiate_kernel_block_sizes
from attnplug.runner.execute.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from attnplug.runner.execute.cudagraph import CUDAGraphMode
from attnplug.runner.execute.cudagraph_capture import StepGraphs
from attnplug.runner.execute.sampler import Sampler
from attnplug.runner.execute.state_copies import apply_state_copies
from attnplug.runner.execute.spec_decode.rejection_sampler import RejectionSampler
from attnplug.runner.execute.spec_decode.state_commit import commit_draft_states
from attnplug.runner.execute.spec_decode.verify import verified_logits, verify_step
from attnplug.runner.step.scheduler_output import SchedulerOutput
from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.prompt_embeds import PromptEmbedsConfig
from attnplug.runner.execute.mm_inputs import MultiModalInputs, multimodal_config

__all__ = ["ModelRunner", "ModelRunnerOutput", "RunnerConfig", "STAGES"]

STAGES = ("update_states", "prepare_inputs", "metadata_build", "forward", "sample")


@dataclass(frozen=True)
class RunnerConfig:
    """Limits the runner sizes its persistent buffers by."""

    max_num_reqs: int
    max_model_len: int
    max_num_batched_tokens: int


class HostBufferFence:
    """A CUDA event marking when a step's host-to-device input copies have been queued.

    ``mark()`` records it on the current stream after the step's copies; ``wait()`` blocks
    the host until the device has passed it, i.e. until those copies have read the pinned
    host buffers that the next step is about to overwrite (vLLM V1's runner waits on a
    similar event before preparing inputs under asynchronous scheduling).
    """

    def __init__(self) -> None:
        self._event = torch.cuda.Event()
        self._marked = False

    def mark(self) -> None:
        self._event.record()
        self._marked = True

    def wait(self) -> None:
        if self._marked:
            self._event.synchronize()


def _refuse_drafts_on_unverifying_state_backends(kv_cache_config: KVCacheConfig,
                                                 backends: Sequence[type[AttentionBackend]]) -> None:
    """Speculative decoding (``state_slots_per_request > 1``) needs every state group's backend
    to serve verifying rows (``StateBackend.supports_draft_verification``).

    Raises:
        ConfigError: ``--speculative``, naming each group and backend that does not.
    """
    if kv_cache_config.state_slots_per_request <= 1:
        return
    unable = [f"group {g} ({b.get_name()})" for g, (grp, b) in enumerate(zip(kv_cache_config.groups, backends))
              if grp.kv_cache_spec.kind is GroupKind.MAMBA and not getattr(b, "supports_draft_verification", False)]
    if unable:
        raise ConfigError("--speculative", f"state backend(s) of {', '.join(unable)} do not verify drafts "
                          "(StateBackend.supports_draft_verification; mamba2_torch does): run without --speculative")


def prompt_embeds_config(model: torch.nn.Module, cudagraph_mode) -> PromptEmbedsConfig:
    """The compiler's prompt-embeddings config for ``model``.

    Raises:
        ValueError: ``model.forward`` takes no ``inputs_embeds``, or CUDA graphs are asked
            for (a captured forward replays ``input_ids`` only).
    """
    if "inputs_embeds" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"enable_prompt_embeds: {type(model).__name__}.forward takes no inputs_embeds")
    if CUDAGraphMode.parse(cudagraph_mode) is not CUDAGraphMode.NONE:
        raise ValueError("enable_prompt_embeds needs cudagraph_mode none (graphs replay input_ids only)")
    return PromptEmbedsConfig(model.config.hidden_size, model.dtype)


class ModelRunner:
    """Executes scheduler outputs on a model whose attention layers use pluggable backends.

    Args:
        model: a ``runner.models`` decoder model (``forward``, ``compute_logits``,
            ``kv_cache_specs``), its attention impls already created from the backends.
        kv_cache_config: the cache groups (layer names and specs) and blocks per group.
        backends: one backend class per cache group (group order).
        config: the buffer limits.
        device: the compute device.
        record_logits: keep the sampled rows' logits in each output (parity checks).
        enable_builder_cache: reuse one metadata build across groups with the same spec
            and builder class.
        cudagraph_mode: ``None``/``"none"`` (default: no padding, no graphs), or the
            requested :class:`~attnplug.runner.execute.cudagraph.CUDAGraphMode`; the runner
            negotiates it down to what every builder supports (``self.cudagraphs.decision``
            says why) and pads steps to ``cudagraph_capture_sizes``. Graphs are captured
            on CUDA only; on a CPU steps are just padded.
        cudagraph_capture_sizes: default ``runner.execute.cudagraph.DEFAULT_CAPTURE_SIZES``.
        cascade: when steps run cascade attention (``runner/execute/cascade.py``; default
            ``CascadeConfig()``); ``self.cascade.decisions`` is the latest step's.
        enable_prompt_embeds: take ``NewRequestData.prompt_embeds`` (vLLM's
            ``--enable-prompt-embeds``; width ``model.config.hidden_size``, dtype
            ``model.dtype``); steps with embedding rows pass ``inputs_embeds`` and
            ``is_embed`` to ``model.forward`` (``runner/step/prompt_embeds.py``), the others
            ``input_ids`` alone. Needs a model whose ``forward`` takes them and no CUDA graphs.
        encoder_cache_tokens: a model with ``embed_image`` (Qwen2-VL) takes
            ``NewRequestData.mm_features``; its encoder outputs are cached up to this many
            rows (default ``max(max_num_batched_tokens, max_model_len)``;
            ``runner/execute/encoder_cache.py``). A model with ``uses_mrope`` gets
            ``StepInputs.mrope_positions`` ``[3, n]`` as its positions.

    Raises:
        BackendUnsupportedError: a backend cannot serve a group's block size, or a Mamba
            group's backend is not a ``MambaBackend`` (``runner.execute.kv_caches``).
        KVCacheSpecError: not one backend per cache group.
    """

    def __init__(self, model: torch.nn.Module, kv_cache_config: KVCacheConfig,
                 backends: Sequence[type[AttentionBackend]], config: RunnerConfig,
                 device: torch.device | str = "cpu", *, record_logits: bool = False,
                 enable_builder_cache: bool = True, seed: int = 0,
                 cudagraph_mode: CUDAGraphMode | str | None = None,
                 cudagraph_capture_sizes: Sequence[int] | None = None,
                 cascade: CascadeConfig | None = None, enable_prompt_embeds: bool = False,
                 encoder_cache_tokens: int | None = None):
        self.model = model
        self.kv_cache_config = kv_cache_config
        self.backends = list(backends)
        self.config = config
        self.device = resolve_device(device)
        self.record_logits = record_logits
        groups = kv_cache_config.groups
        _refuse_drafts_on_unverifying_state_backends(kv_cache_config, self.backends)
        kernel_block_sizes = negotiate_kernel_block_sizes(kv_cache_config, self.backends)
        self.kernel_block_sizes = kernel_block_sizes
        builder_cfg = BuilderConfig(config.max_num_reqs, config.max_num_batched_tokens, config.max_model_len,
                                    dtype=getattr(model, "dtype", None))
        builders = []
        for group, backend, kbs in zip(groups, self.backends, kernel_block_sizes):
            builders.append(backend.get_builder_cls()(kernel_kv_cache_spec(group.kv_cache_spec, kbs),
                                                      list(group.layer_names), builder_cfg, self.device))
        threshold = [b.reorder_batch_threshold for b in builders if b.reorder_batch_threshold is not None]
        self.compiler = StepCompiler(
            block_sizes=[g.kv_cache_spec.block_size for g in groups],
            num_blocks=[kv_cache_config.num_blocks_of(g) for g in range(len(groups))],
            max_num_reqs=config.max_num_reqs,
            max_model_len=config.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            device=self.device,
            kernel_block_sizes=kernel_block_sizes,
            reorder_batch_threshold=min(threshold) if threshold else None,
            group_kinds=[g.kv_cache_spec.kind for g in groups],
            sliding_windows=[getattr(g.kv_cache_spec, "sliding_window", None) for g in groups],
            prompt_embeds=prompt_embeds_config(model, cudagraph_mode) if enable_prompt_embeds else None,
            uses_mrope=bool(getattr(model, "uses_mrope", False)), multimodal=multimodal_config(
                model, CUDAGraphMode.parse(cudagraph_mode) is not CUDAGraphMode.NONE),
        )
        self.mm_inputs: MultiModalInputs | None = None
        """Images (a model with ``embed_image``): the encoder cache and the image rows' buffer."""
        if self.compiler.mm is not None:
            self.mm_inputs = MultiModalInputs(
                model, config.max_num_batched_tokens, model.config.hidden_size, model.dtype, self.device,
                encoder_cache_tokens or max(config.max_num_batched_tokens, config.max_model_len))
        self.metadata_builder = GroupMetadataBuilder(
            builders, [list(g.layer_names) for g in groups], enable_caching=enable_builder_cache)
        self.cascade = CascadePlanner(cascade or CascadeConfig(), builders,
                                      [g.kv_cache_spec.kind != "full_attention" for g in groups])
        self.cudagraphs: StepGraphs | None = None
        if CUDAGraphMode.parse(cudagraph_mode) is not CUDAGraphMode.NONE:
            self.cudagraphs = StepGraphs(builders, [b.get_name() for b in self.backends], cudagraph_mode,
                                         self.device, config.max_num_reqs, config.max_num_batched_tokens,
                                         cudagraph_capture_sizes)
        self.kv_caches = allocate_kv_caches(kv_cache_config, self.backends, kernel_block_sizes, self.device)
        self.sampler = Sampler(default_seed=seed)
        self.rejection_sampler = RejectionSampler(default_seed=seed)
        self._num_draft_tokens: list[int] = []  # the last verifying step's, for record_logits
        # Each step's inputs reach the device by non-blocking copies out of pinned host buffers
        # that the next step rewrites; a step that samples nothing never waits for the device,
        # so the next one first waits for this fence (CUDA only; None on the CPU).
        self.host_buffer_fence: HostBufferFence | None = (
            HostBufferFence() if self.device.type == "cuda" else None)
        self.timings_ns: dict[str, list[int]] = {s: [] for s in STAGES}
        self._prev_tokens: torch.Tensor | None = None
        """Asynchronous scheduling: the latest step's sampled tokens, on the device."""
        self._unread: list[AsyncModelRunnerOutput] = []
        """``execute_model_async`` outputs whose ``result()`` was not called yet (<= 2)."""
        self.on_common_metadata = None
        """Optional ``callable([CommonAttentionMetadata per cache group])`` run each step before the builders."""
        self.num_output_waits = 0
        """Times a step's outputs were waited for (``AsyncModelRunnerOutput.result``)."""
        self.output_wait_ns = 0
        """Nanoseconds spent in those waits (the device-to-host copy of the tokens)."""
        self.kv_connector = None
        """The worker-side KV connector (``kv_transfer.attach_kv_connector``), or ``None``."""
        self.kv_connector_step_ns: list[int] = []
        """Per step, nanoseconds in the connector's hooks (loads started and finished, saves)."""

    def reset_stats(self) -> None:
        """Start the figures afresh (``LLMEngine.reset_stats``, after warm-up): stage
        timings, output waits, metadata builds / reuses and cascade decisions."""
        self.timings_ns = {s: [] for s in STAGES}
        self.num_output_waits = 0
        self.output_wait_ns = 0
        self.metadata_builder.counters = type(self.metadata_builder.counters)()
        self.cascade.num_cascade_steps = self.cascade.num_steps = 0
        self.cascade.reason_counts = {}
        self.kv_connector_step_ns = []

    def _time(self, stage: str, t0: int) -> int:
        t1 = time.perf_counter_ns()
        self.timings_ns[stage].append(t1 - t0)
        return t1

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; its sampled tokens enter the token history before it returns.

        Raises:
            InvalidSchedulerOutput: the output cannot be applied (state unchanged).
            MetadataInvariantError: with ``ATTNPLUG_VALIDATE=1``, a broken invariant.
            MetadataError: a result of :meth:`execute_model_async` is still unread.
        """
        if self._unread:
            raise MetadataError("execute_model: read every execute_model_async result first")
        if self.kv_connector is None:
            return self._execute(scheduler_output)
        kv_transfer.before_forward(self, scheduler_output)
        out = self._execute(scheduler_output)
        out.kv_connector_output = kv_transfer.after_forward(self, bool(out.req_ids))
        return out

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        step = self._run(scheduler_output, None)
        if step is None:
            return ModelRunnerOutput([], {})
        req_ids, rows, tokens_dev, logits = step
        if isinstance(tokens_dev, list):  # speculative decoding: each row's emitted tokens
            commit_draft_states(self, rows, tokens_dev)  # state groups: the accepted length's state
            self.compiler.append_verified_tokens(rows, tokens_dev)
            return ModelRunnerOutput(req_ids, dict(zip([req_ids[r] for r in rows.tolist()], tokens_dev)),
                                     verified_logits(req_ids, rows, tokens_dev, logits, self._num_draft_tokens)
                                     if self.record_logits else {})
        tokens = tokens_dev.cpu().tolist() if rows.shape[0] else []
        if tokens:
            self.compiler.append_output_tokens(rows, [[tok] for tok in tokens])
        return ModelRunnerOutput(req_ids, {req_ids[r]: [tok] for r, tok in zip(rows.tolist(), tokens)},
                                 self._logits_by_req(req_ids, rows, logits))

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Run one step without waiting for its tokens (asynchronous scheduling).

        The step's sampled tokens stay on the device: the token history gets placeholders
        (``runner/step/placeholders.py``) and the next step's ``input_ids`` take the tokens
        from the device. Call the returned object's ``result()`` (the one wait per step,
        ``runner/execute/outputs.py``: ``AsyncModelRunnerOutput``) after launching the next step and before the
        one after it.

        Raises:
            InvalidSchedulerOutput, MetadataInvariantError: as :meth:`execute_model`.
            MetadataError: the result of the step before the previous one is still unread, or
                the step carries draft tokens (speculative decoding is synchronous).
        """
        if self.kv_connector is not None:
            raise MetadataError("execute_model_async: a KV connector needs synchronous steps (execute_model)")
        if len(self._unread) >= 2:
            raise MetadataError("execute_model_async: at most one step in flight; read the older result first")
        pk = scheduler_output.packed_cached
        if scheduler_output.scheduled_spec_decode_tokens or (  # docs/speculative-decoding.md
                isinstance(getattr(pk, "num_draft_tokens", None), np.ndarray) and np.count_nonzero(pk.num_draft_tokens)):
            raise MetadataError("execute_model_async: a step with draft tokens needs execute_model "
                                "(speculative decoding runs with synchronous scheduling)")
        step = self._run(scheduler_output, self._prev_tokens)
        if step is None:
            out = AsyncModelRunnerOutput.empty(self)
        else:
            req_ids, rows, tokens_dev, logits = step
            placeholders = self.compiler.append_placeholders(rows)
            self._prev_tokens = tokens_dev
            out = AsyncModelRunnerOutput(self, req_ids, placeholders, tokens_dev,
                                         self._logits_by_req(req_ids, rows, logits))
        self._unread.append(out)
        return out

    def _result_read(self, out: AsyncModelRunnerOutput) -> None:
        """``out.result()`` was called (its tokens are in the host history now)."""
        self._unread.remove(out)

    def _run(self, scheduler_output: SchedulerOutput, prev_tokens: torch.Tensor | None):
        """update → prepare → build → forward → sample; ``None`` for an empty step, else
        ``(req_ids, rows that sampled, [n] sampled tokens on the device, logits or None)``."""
        t = time.perf_counter_ns()
        if self.host_buffer_fence is not None:
            self.host_buffer_fence.wait()  # the last step's copies out of the host buffers are done
        self.compiler.update_states(scheduler_output)
        if self.mm_inputs is not None:
            self.mm_inputs.applied(scheduler_output)
        t = self._time("update_states", t)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return None
        graphs, batch = self.cudagraphs, None
        if graphs is not None:  # pad for CUDA graphs (runner/execute/cudagraph.py)
            rows = self.compiler.input_batch
            batch = graphs.dispatch(rows.num_scheduled_tokens[:rows.num_reqs])
        inputs = self.compiler.prepare_inputs(scheduler_output, batch.num_tokens_padded if batch else None,
                                              prev_token_ids=prev_tokens)
        t = self._time("prepare_inputs", t)
        common = graphs.common_metadata(inputs.common_attn_metadata, batch) if batch else inputs.common_attn_metadata
        if self.on_common_metadata is not None:  # e.g. the cross-rank check (runner/parallel/validate.py)
            self.on_common_metadata(common)
        prefix_lens = self.cascade.plan(self.compiler, common, padded=batch is not None)
        _, per_layer = self.metadata_builder.build(common, prefix_lens, for_cudagraph=bool(batch and batch.use_graph))
        if self.host_buffer_fence is not None:
            self.host_buffer_fence.mark()  # after every copy out of the host buffers is queued
        t = self._time("metadata_build", t)
        n = inputs.num_padded_tokens
        if self.mm_inputs is not None:  # images: encoder rows (runner/execute/mm_inputs.py)
            embeds = self.mm_inputs.embeds(inputs, n)
        else:
            embeds = {} if inputs.inputs_embeds is None else {"inputs_embeds": inputs.inputs_embeds[:n],
                                                              "is_embed": inputs.is_embed[:n]}
        pos = inputs.positions[:n] if inputs.mrope_positions is None else inputs.mrope_positions[:, :n]
        forward = lambda: self.model(inputs.input_ids[:n], pos, per_layer, self.kv_caches, **embeds)  # noqa: E731
        apply_state_copies(self, scheduler_output, "restores")  # Mamba prefix hits (state_copies.py)
        hidden = graphs.forward(batch, forward) if batch else forward()
        apply_state_copies(self, scheduler_output, "saves")
        if self.mm_inputs is not None:
            self.mm_inputs.done(inputs)
        t = self._time("forward", t)

        keep = np.flatnonzero(~np.asarray(inputs.discard))
        req_ids = list(inputs.req_ids)
        tokens = torch.empty(0, dtype=torch.int64, device=hidden.device)
        logits = None
        if inputs.spec_decode_metadata is not None:  # runner/execute/spec_decode/verify.py
            tokens, logits = verify_step(self.model, self.rejection_sampler, self.compiler.requests, inputs,
                                         hidden, req_ids, keep)
            self._num_draft_tokens = inputs.spec_decode_metadata.num_draft_tokens
        elif len(keep):
            idx = upload(inputs.logits_indices_cpu.numpy()[keep], hidden.device)  # pinned, no host sync
            logits = self.model.compute_logits(hidden.index_select(0, idx))
            states = [self.compiler.requests[req_ids[r]] for r in keep.tolist()]
            tokens = self.sampler(logits, [st.sampling_params for st in states], [st.generator for st in states])
        self._time("sample", t)
        return req_ids, keep, tokens, logits

    def _logits_by_req(self, req_ids: list[str], rows: np.ndarray, logits: torch.Tensor | None) -> dict:
        if not self.record_logits or logits is None:
            return {}
        logits_cpu = logits.float().cpu()
        return {req_ids[r]: logits_cpu[i] for i, r in enumerate(rows.tolist())}

    def median_stage_us(self) -> dict[str, float]:
        """Median microseconds per step of each stage (steps that ran it)."""
        return {s: (float(np.median(v)) / 1e3 if v else 0.0) for s, v in self.timings_ns.items()}
