"""Assemble an engine from command-line style options: model, cache groups, backends,
scheduler, runner, and the trace's requests. Used by ``attnplug run`` and ``parity``."""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
from attnplug.cache_groups.specs import cdiv
from attnplug.core.contracts import AttentionBackend, AttentionLayerConfig
from attnplug.core.errors import AttnplugError
from attnplug.runner.serve.engine import LLMEngine
from attnplug.runner.execute.model_runner import ModelRunner, RunnerConfig
from attnplug.runner.commands.speculative import spec_summary
from attnplug.runner.commands.draft_setup import attach_draft_model
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
from attnplug.runner.step.scheduler_output import SamplingParams
from attnplug.runner.commands.limits import clip, memory_problem
from attnplug.runner.commands.traces import BUNDLED_ATTRIBUTION, BUNDLED_TRACES
from attnplug.runner.commands.prefix_report import prefix_caching_summary
from attnplug.runner.commands.kv_connector_setup import kv_connector_summary, make_connectors
from attnplug.runner.commands.shared_prefixes import SYSTEM_PROMPT_LEN, SYSTEM_PROMPTS, make_shared_prefix_prompts
from attnplug.runner.execute.cascade import CascadeConfig


@dataclass
class EngineSetup:
    """An engine and everything a command reports about it."""

    model: torch.nn.Module
    engine: LLMEngine
    kv_cache_config: KVCacheConfig
    backends: list[type[AttentionBackend]]
    prompts: dict[str, list[int]] = field(default_factory=dict)
    sampling_params: dict[str, SamplingParams] = field(default_factory=dict)
    trace_info: dict[str, Any] = field(default_factory=dict)
    trace_arrival_s: dict[str, float] = field(default_factory=dict)
    """Per request, its arrival in the trace (seconds after the first loaded request)."""
    texts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Real-weight runs: per request id, its prompt's labels and text (``text_requests.py``)."""
    kv_cache: dict[str, Any] = field(default_factory=lambda: {"dtype": "auto"})
    """``{"dtype"}`` (``auto``), or for fp8 also ``"scales"`` (their source) and ``"granularity"``
    (``runner/commands/kv_cache_setup.py``)."""

    def summary(self, results: dict, wall_s: float) -> dict[str, Any]:
        """Machine-readable summary of a finished run (what ``--json`` prints)."""
        eng = self.engine
        runner = eng.runner
        counters = runner.metadata_builder.counters
        generated = sum(len(r.output_token_ids) for r in results.values())
        return {
            "requests": len(results),
            "steps": eng.stats.num_steps,
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in results.values()),
            "generated_tokens": generated,
            "scheduled_tokens": eng.stats.num_scheduled_tokens,
            "wall_time_s": round(wall_s, 3),
            "tokens_per_s": round(eng.stats.num_scheduled_tokens / wall_s, 1) if wall_s else 0.0,
            "generated_tokens_per_s": round(generated / wall_s, 1) if wall_s else 0.0,
            "preemptions": eng.scheduler.num_preemptions,
            "median_us_per_step": {k: round(v, 1) for k, v in runner.median_stage_us().items()},
            "peak_kv_blocks_per_group": list(eng.scheduler.peak_blocks_per_group),
            "num_blocks_per_group": self.kv_cache_config.num_blocks,
            "cache_groups": [
                {"kind": g.kv_cache_spec.kind, "layers": len(g.layer_names), "backend": b.get_name(),
                 "block_size": g.kv_cache_spec.block_size,
                 "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
                 "kv_cache_dtype": str(getattr(g.kv_cache_spec, "dtype", "")).replace("torch.", ""),
                 "capacity": self.kv_cache_config.num_blocks_of(i) - 1,
                 "bytes_per_token_per_layer": kv_bytes_per_token(g.kv_cache_spec),
                 "kv_cache_bytes": self.kv_cache_config.num_blocks_of(i) * g.kv_cache_spec.page_size_bytes
                 * len(g.layer_names)}
                for i, (g, b) in enumerate(zip(self.kv_cache_config.groups, self.backends))
            ],
            "kv_cache": dict(self.kv_cache),
            "metadata_builds_per_step": round(counters.total_builds / max(counters.steps, 1), 2),
            "metadata_reuses_per_step": round(counters.total_reuses / max(counters.steps, 1), 2),
            "trace": self.trace_info,
            "async_scheduling": eng.async_scheduling,
            "steps_per_s": round(eng.stats.num_steps / wall_s, 1) if wall_s else 0.0,
            "output_waits": runner.num_output_waits,
            "output_wait_ms": round(runner.output_wait_ns / 1e6, 3),
            "torch_threads": torch.get_num_threads(),
            "outputs_digest": outputs_digest(results),
            **prefix_caching_summary(eng),
            **spec_summary(eng),  # runner/commands/speculative.py
            **kv_connector_summary(eng),  # --kv-connector (kv_connector_setup.py)
        }


def outputs_digest(results: dict) -> str:
    """sha256 (hex) of every request's generated token ids, in request-id order (ids that
    end in a number sort by it: ``req-2`` before ``req-10``), so two runs compare by one value."""
    def key(rid: str):
        head, _, tail = rid.rpartition("-")
        return (head, int(tail)) if tail.isdigit() else (rid, -1)

    payload = json.dumps([[rid, list(map(int, results[rid].output_token_ids))] for rid in sorted(results, key=key)])
    return hashlib.sha256(payload.encode()).hexdigest()


def kv_cache_bytes(kv_cfg: KVCacheConfig) -> int:
    """Bytes of every layer's KV cache (or Mamba state slots) for ``kv_cfg``, in the default
    layout (``runner/execute/kv_caches.allocate_kv_caches``: ``num_blocks_of(g) *
    page_size_bytes`` per layer of group ``g``)."""
    return sum(kv_cfg.num_blocks_of(g) * grp.kv_cache_spec.page_size_bytes * len(grp.layer_names)
               for g, grp in enumerate(kv_cfg.groups))


def check_kv_memory(kv_cfg: KVCacheConfig, max_num_seqs: int, max_model_len: int, device: str,
                    origin: str, available: int | None = None) -> None:
    """Refuse, before anything is allocated, KV pools (plus the ``int32`` token table of
    ``max_num_seqs x max_model_len``) that do not fit the memory available.

    Only for a CPU ``device``: a GPU pool is refused by the device's allocator instead. The
    memory available comes from ``limits.available_memory_bytes`` (``/proc/meminfo``,
    ``os.sysconf``); when it is unknown nothing is refused.

    Raises:
        AttnplugError: one line naming the pool size, ``origin`` (the flag that set it),
            the bytes needed and the memory available.
    """
    if str(device).split(":")[0] != "cpu":
        return
    need = kv_cache_bytes(kv_cfg) + max_num_seqs * max_model_len * 4
    why = memory_problem(f"{kv_cfg.num_blocks} blocks per cache group ({origin}) in "
                         f"{len(kv_cfg.groups)} cache group(s)", need, available)
    if why:
        raise AttnplugError(f"{why}; lower --num-blocks (its default follows --max-num-seqs and "
                            "--max-model-len)")


class BackendBuildError(AttnplugError):
    """A selected backend that cannot be built: its ``get_builder_cls`` / ``get_impl_cls``
    raised or returned something that is not a class, or its builder's constructor raised.
    The message names the backend, the cache group (kind, and index once groups exist),
    how the backend was chosen, and the exception."""


def _build_failure(backend: type[AttentionBackend], group: str, what: str, exc: BaseException | str) -> BackendBuildError:
    name = getattr(backend, "__qualname__", repr(backend))
    try:
        name = repr(backend.get_name())
    except Exception:
        pass
    if isinstance(exc, str):
        why = exc
    else:
        text = " ".join(str(exc).split())
        why = f"raised {type(exc).__name__}: {text if len(text) <= 300 else text[:300] + '...'}"
    return BackendBuildError(f"backend {name} selected for {group}: {what} {why}")


def kv_bytes_per_token(spec) -> int | None:
    """Cache bytes one token costs in ONE layer of a group (``page_size_bytes / block_size``:
    K and V for attention, the latent row for MLA: ``(kv_lora_rank + qk_rope_head_dim) x
    dtype size``, 1152 for DeepSeek-V3 in bfloat16); ``None`` for state groups."""
    if spec.kind == "mamba":
        return None
    return spec.page_size_bytes // spec.block_size


def check_buildable(backend: type[AttentionBackend], group: str) -> None:
    """``backend.get_builder_cls()`` and ``get_impl_cls()`` return classes.

    Raises:
        BackendBuildError: either raised, or returned ``None`` or another non-class.
    """
    for method in ("get_builder_cls", "get_impl_cls"):
        try:
            cls = getattr(backend, method)()
        except Exception as exc:
            raise _build_failure(backend, group, f"{method}()", exc) from exc
        if not inspect.isclass(cls):
            raise _build_failure(backend, group, f"{method}()", f"returned {clip(cls)}, not a class")


def check_builders(kv_cfg: KVCacheConfig, backends: list[type[AttentionBackend]], budget: int,
                   max_num_seqs: int, max_model_len: int, device: str, dtype: torch.dtype | None = None) -> None:
    """Construct each cache group's builder once, as ``ModelRunner`` will
    (``docs/embedding.md``), so that a builder whose constructor raises is named.

    Raises:
        BackendBuildError: a builder's constructor raised (group index and kind named).
        BackendUnsupportedError: a backend cannot serve its group's block size.
    """
    from attnplug.core.contracts import BuilderConfig
    from attnplug.runner.execute.kv_caches import kernel_kv_cache_spec, negotiate_kernel_block_sizes

    sizes = negotiate_kernel_block_sizes(kv_cfg, backends)
    cfg = BuilderConfig(max_num_seqs, budget, max_model_len, dtype=dtype)
    for g, (group, backend, kbs) in enumerate(zip(kv_cfg.groups, backends, sizes)):
        where = f"cache group {g} ({group.kv_cache_spec.kind.value})"
        check_buildable(backend, where)
        try:
            backend.get_builder_cls()(kernel_kv_cache_spec(group.kv_cache_spec, kbs), list(group.layer_names),
                                      cfg, device)
        except AttnplugError:
            raise
        except Exception as exc:
            raise _build_failure(backend, where, "its builder", exc) from exc


def resolve_backend(name: str | None, layer_cfgs: dict[str, AttentionLayerConfig],
                    kind_of: dict[str, str]) -> dict[str, type[AttentionBackend]]:
    """The backend of every attention layer (explicit ``name`` for all, else automatic).

    Raises:
        BackendBuildError: a chosen backend's ``get_builder_cls`` / ``get_impl_cls``
            raised or returned no class (before the model builds any layer with it).
        AttnplugError: the selection's own errors (``plugins/selection.py``).
    """
    from attnplug.plugins.selection import select_backend

    chosen: dict[str, type[AttentionBackend]] = {}
    memo: dict[tuple, type[AttentionBackend]] = {}
    for layer, cfg in layer_cfgs.items():
        key = (cfg, kind_of[layer])
        if key not in memo:
            result = select_backend(cfg, kind_of[layer], cli_choice=name)
            check_buildable(result.backend_cls, f"the {kind_of[layer]} cache group (chosen by {result.origin})")
            memo[key] = result.backend_cls
        chosen[layer] = memo[key]
    return chosen


def speculative_config(args):
    """``args.speculative`` (a ``--speculative`` string, a parsed config, or absent: then
    ``[speculative]`` of ``attnplug.toml``, ``runner/commands/speculative.py``)."""
    from attnplug.runner.commands.speculative import resolve_speculative
    from attnplug.runner.execute.spec_decode.drafter import SpeculativeConfig

    spec = getattr(args, "speculative", None)
    return spec if isinstance(spec, SpeculativeConfig) else resolve_speculative(spec)


def build_engine(args, *, alone: bool = False, model: torch.nn.Module | None = None,
                 requests: bool = True) -> EngineSetup:
    """Build model (unless given), cache config, backends, scheduler, runner and requests.

    ``alone=True`` makes a batch-of-one engine without chunking (the invariance check).

    Raises:
        AttnplugError: bad options, an unsupported model or backend, a bad trace.
    """
    from attnplug.runner.commands.model_loading import load_model_for_run

    torch.manual_seed(args.seed)
    device = getattr(args, "device", "cpu")
    from attnplug.runner.commands import kv_cache_setup

    if model is None:
        model = load_model_for_run(args.model, backend=args.backend, block_size=args.block_size,
                                   seed=args.seed, resolve=resolve_backend, device=device,
                                   kv_cache_dtype=kv_cache_setup.cache_dtype(args))
    kv_info = kv_cache_setup.prepare_scales(model, args)  # fp8: k_scale / v_scale on every attention layer
    specs = kv_cache_setup.quantized_specs(model.kv_cache_specs(args.block_size), kv_cache_setup.cache_dtype(args))
    groups = group_layers_by_spec(specs)
    max_model_len = args.max_model_len
    max_num_seqs = 1 if alone else args.max_num_seqs
    budget = max_model_len if alone else args.max_num_batched_tokens
    spec_cfg = speculative_config(args)
    kv_cfg = _kv_cache_config(args, groups, max_num_seqs, max_model_len, spec_cfg, alone)
    check_kv_memory(kv_cfg, max_num_seqs, max_model_len, device,
                    "--num-blocks" if args.num_blocks else "the default --num-blocks")
    backends = [model.attnplug_backends[g.layer_names[0]] for g in groups]
    check_builders(kv_cfg, backends, budget, max_num_seqs, max_model_len, device, getattr(model, "dtype", None))
    kv_sched, kv_worker = make_connectors(args, kv_cfg, backends, alone, kv_info)  # --kv-connector
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                      max_model_len=max_model_len, enable_chunked_prefill=not alone,
                                      force_preemption_every=getattr(args, "force_preemption_every", None),
                                      async_scheduling=getattr(args, "async_scheduling", False),
                                      enable_prefix_caching=getattr(args, "prefix_caching", False),
                                      speculative=attach_draft_model(spec_cfg, args, model,
                                                                     device, resolve_backend)),
                      kv_cfg, kv_connector=kv_sched)
    runner = ModelRunner(model, kv_cfg, backends,
                         RunnerConfig(max_num_reqs=max_num_seqs, max_model_len=max_model_len,
                                      max_num_batched_tokens=budget),
                         device=device, record_logits=getattr(args, "record_logits", False), seed=args.seed,
                         cascade=CascadeConfig(enabled=not getattr(args, "no_cascade", False),
                                               min_prefix_len=getattr(args, "cascade_min_prefix_len", 256),
                                               min_num_reqs=getattr(args, "cascade_min_num_reqs", 8)))
    if kv_worker is not None:
        from attnplug.runner.execute.kv_transfer import attach_kv_connector

        attach_kv_connector(runner, kv_worker)
    from attnplug.runner.parallel.executor import wrap_runner

    runner = wrap_runner(runner, alone)  # tensor parallel: rank 0 broadcasts each step
    setup = EngineSetup(model, LLMEngine(sched, runner), kv_cfg, backends, kv_cache=kv_info or {"dtype": "auto"})
    if requests and not alone and getattr(model, "attnplug_tokenizer", None) is not None:
        from attnplug.runner.commands.text_requests import add_text_requests

        add_text_requests(setup, args, model.attnplug_tokenizer, max_model_len)  # real text, real weights
    elif requests and not alone:
        _add_trace_requests(setup, args, model, max_model_len)  # random-weight presets: the trace's lengths
    return setup


def _kv_cache_config(args, groups, max_num_seqs: int, max_model_len: int, spec_cfg, alone: bool) -> KVCacheConfig:
    """The run's ``KVCacheConfig``: ``--num-blocks`` (default: every request at full length, plus the
    null block) or the blocks ``--kv-cache-memory`` holds; state groups get 1 slot per request,
    ``1 + k`` with ``k`` drafts (scratch slots per draft position), plus room for checkpoints
    with prefix caching."""
    from attnplug.runner.commands import kv_cache_setup

    num_blocks = args.num_blocks or (max_num_seqs * cdiv(max_model_len, args.block_size) + 1)
    if getattr(args, "kv_cache_memory", None) and not args.num_blocks and not alone:
        num_blocks = kv_cache_setup.blocks_for_memory([g.kv_cache_spec for g in groups],
                                                      [len(g.layer_names) for g in groups], args.kv_cache_memory)
    per_req = 1 + (spec_cfg.k if spec_cfg is not None else 0)
    checkpoints = 4 * max_num_seqs if getattr(args, "prefix_caching", False) else 0
    return KVCacheConfig(num_blocks, groups, num_state_slots=max_num_seqs * per_req + 1 + checkpoints,
                         state_slots_per_request=per_req)


def _add_trace_requests(setup: EngineSetup, args, model: torch.nn.Module, max_model_len: int) -> None:
    """Requests from ``args.trace`` (CSV or timed-trace ``.jsonl``) with synthetic prompt ids,
    their sampling params, arrival times and the trace's provenance in ``setup.trace_info``."""
    from attnplug.runner.commands.serving_flags import sampling_params
    from attnplug.runner.commands.timed_trace import is_timed_trace, load_timed_trace
    from attnplug.runner.commands.traces import load_trace, make_prompts

    if is_timed_trace(args.trace):  # its hash_ids make the prompts (timed_trace.py)
        trace, prompts = load_timed_trace(args.trace, args.num_requests, max_model_len=max_model_len,
                                          vocab_size=model.config.vocab_size, seed=args.seed,
                                          chunk_size=getattr(args, "timed_trace_chunk_hash_size", 16),
                                          skip_invalid=args.skip_invalid)
    else:
        trace = load_trace(args.trace, args.num_requests, max_model_len=max_model_len,
                           skip_invalid=args.skip_invalid)
        prompts = make_prompts(trace, model.config.vocab_size, seed=args.seed)
    if (getattr(args, "prefix_caching", False) or getattr(args, "shared_prefixes", False)) \
            and not is_timed_trace(args.trace):
        prompts = make_shared_prefix_prompts([r.prompt_len for r in trace], model.config.vocab_size, args.seed,
                                             num_system_prompts=args.system_prompts or SYSTEM_PROMPTS,
                                             system_prompt_len=args.system_prompt_len or SYSTEM_PROMPT_LEN)
    for i, (tr, prompt) in enumerate(zip(trace, prompts)):
        rid = f"req-{i}"
        setup.prompts[rid] = prompt
        setup.sampling_params[rid] = sampling_params(args, i, tr.output_len)
        setup.trace_arrival_s[rid] = tr.arrival_s
    setup.trace_info = {"source": args.trace, "requests": len(trace), "skipped_rows": trace.num_skipped,
                        "scale": trace.scale}
    if trace.num_skipped:
        setup.trace_info["first_skipped_row"] = trace.first_skipped
    if args.trace in BUNDLED_TRACES:  # the licence (CC-BY 4.0) travels with what the data produced
        setup.trace_info["attribution"] = BUNDLED_ATTRIBUTION
