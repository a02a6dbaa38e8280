"""The builders tables of ``attnplug bench step``: µs per ``build()`` / ``update_block_table()``
per backend, and the full step of hybrid layouts.

**Builders.** On the step compiler's real steps (``prepare_inputs`` of the steady-decode
workloads at each N and of the trace replay, ``runner/commands/bench/workloads.py``), each
backend's builder lowers group 0's common metadata (``build``) and a second builder of the
same class rebinds it to group 1's block table and slot mapping (``update_block_table``,
what ``GroupMetadataBuilder`` does for groups with equal specs), right after the step
compiler's ``prepare_inputs``, one backend per replay. The backends run through
their CPU-runnable builder code: ``torch_native``; ``triton``; ``flash_attn`` is the real
builder planning for FlashAttention 3 (``FlashAttn3EmulatedBuilder``: with no live layer
registered there is no ``get_scheduler_metadata`` call, as with mixed layer parameters);
``flashinfer`` the real builder's page metadata (no live layer: no ``plan()`` call; it has
no ``update_block_table``); ``mamba2`` the Mamba2 builder on a ``MambaSpec`` reading its
state slot from column 0 of the same block table; ``gdn`` the GDN builder (the Mamba2 one with
chunks from each sequence's start and flash-linear-attention's chunk tables) on Qwen3-Next's GDN
state spec; ``mla`` the common MLA builder
(``torch_native_mla`` / ``triton_mla``: decodes first, the context chunk plan) on DeepSeek's
latent spec (512 + 64, bfloat16; it has no ``update_block_table``).

**Full step.** ``update_states`` + ``prepare_inputs`` (with the common metadata) + every
group's builder (``GroupMetadataBuilder``, caching on) for the ``tiny-hybrid`` layout
(sliding window + full attention + Mamba2: 3 groups) and the 48-layer hybrid (6 groups),
attention groups on ``triton`` (and ``torch_native``), Mamba groups on ``mamba2``. The
steps come from the real ``Scheduler``: steady decode of N requests (prompts prefilled
first, not timed) and the conversation trace.

Each workload is replayed ``repeat`` times with fresh compilers and builders; a figure is
the median over the steps of one replay, reported as min / median / max over replays.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

import numpy as np
import torch

from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
from attnplug.cache_groups.kinds import GroupKind
from attnplug.cache_groups.specs import (FullAttentionSpec, KVCacheSpec, MambaSpec, MLAAttentionSpec, StateSpec,
                                         StateTensorSpec, cdiv)
from attnplug.core.contracts import BuilderConfig
from attnplug.runner.commands.bench.metadata import (
    LAYERS_PER_GROUP,
    hybrid_layer_specs,
    hybrid_trace_replay,
    tiny_hybrid_layer_specs,
)
from attnplug.runner.commands.bench.workloads import PROMPT_LENGTHS, Workload, steady_decode, trace_replay
from attnplug.runner.execute.group_metadata import GroupMetadataBuilder
from attnplug.runner.step.compiler import StepCompiler

BACKENDS = ("torch_native", "triton", "flash_attn", "flashinfer", "mamba2", "gdn", "mla")
BUILDER_TARGETS_US = {("triton", 256): 8.0, ("triton", 1024): 20.0, ("flash_attn", 256): 20.0,
                      ("flash_attn", 1024): 45.0, ("mamba2", 256): 40.0, ("torch_native", 256): 60.0}
"""Issue 14's targets for ``build()`` on steady decode (µs, median)."""
FULL_STEP_TARGETS_US = {("tiny-hybrid", "triton", 256): 175.0}
ATTN_SPEC = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
MLA_SPEC = MLAAttentionSpec(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16)
MAMBA_SPEC = MambaSpec(block_size=16, conv_state_shape=(4096 + 512, 3), ssm_state_shape=(64, 64, 128),
                       dtype=torch.bfloat16, ssm_dtype=torch.float32, chunk_size=256)
GDN_SPEC = StateSpec(block_size=16, state_kind="gdn", chunk_size=64, tensors=(
    StateTensorSpec("conv_state", (2 * 16 * 128 + 32 * 128, 3), torch.bfloat16),
    StateTensorSpec("recurrent_state", (32, 128, 128), torch.float32)))
"""Qwen3-Next-80B's GDN layer: 16 key heads, 32 value heads, head dims 128, conv kernel 4."""


def builder_class(name: str) -> type:
    """The builder class ``name`` runs through (module docstring)."""
    if name == "torch_native":
        from attnplug.backends.torch_native.builder import TorchNativeMetadataBuilder as cls
    elif name == "triton":
        from attnplug.backends.triton.builder import TritonMetadataBuilder as cls
    elif name == "flash_attn":
        from attnplug.backends.emulators.backends import FlashAttn3EmulatedBuilder as cls
    elif name == "flashinfer":
        from attnplug.backends.emulators.backends import FlashInferEmulatedBuilder as cls
    elif name == "mamba2":
        from attnplug.backends.mamba2.metadata import Mamba2MetadataBuilder as cls
    elif name == "gdn":
        from attnplug.backends.state.gdn.metadata import GDNMetadataBuilder as cls
    elif name == "mla":
        from attnplug.backends.mla.common.builder import MLACommonMetadataBuilder as cls
    else:
        raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    return cls


def spread(samples: list[float]) -> dict[str, float]:
    """``{"min", "median", "max"}`` of per-replay medians (µs)."""
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def _median_us(ns: list[int]) -> float:
    return float(np.median(np.asarray(ns, dtype=np.float64))) / 1e3 if ns else float("nan")


def _replay(workload: Workload, steps: int, compiler_kw: dict, per_step: Callable) -> int:
    """Replay warm-up + ``steps`` steps through a fresh ``StepCompiler``; ``per_step(i, sc,
    so)`` runs the step's timed part (``i < 0`` during warm-up). Returns the timed steps."""
    cfg = dict(workload.config)
    sc = StepCompiler(cfg.pop("block_sizes"), validate=False, **compiler_kw, **cfg)
    n = max(0, min(steps, len(workload.steps) - workload.num_warmup))
    gc.collect()
    gc.disable()
    try:
        for i, so in enumerate(workload.steps[:workload.num_warmup + n]):
            inputs = per_step(i - workload.num_warmup, sc, so)
            keep = np.flatnonzero(~inputs.discard)
            sc.append_output_tokens(keep, np.ones(keep.shape[0], dtype=np.int64))
    finally:
        gc.enable()
    return n


def time_builders(workload: Workload, steps: int, backend: str) -> dict[str, float]:
    """One replay with one backend's builders: ``{"build" | "update_block_table": median µs}``.

    One backend per replay: a builder timed right after another backend's (which may
    allocate megabytes) would pay for that one's cache misses."""
    c = workload.config
    bcfg = BuilderConfig(c["max_num_reqs"], c["max_num_batched_tokens"], c["max_model_len"])
    spec = {"mamba2": MAMBA_SPEC, "gdn": GDN_SPEC, "mla": MLA_SPEC}.get(backend, ATTN_SPEC)
    cls = builder_class(backend)
    first, second = cls(spec, ["g0"], bcfg, "cpu"), cls(spec, ["g1"], bcfg, "cpu")
    times: dict[str, list[int]] = {"build": [], "update_block_table": []}
    clock = time.perf_counter_ns

    def step(i, sc, so):
        sc.update_states(so)
        inputs = sc.prepare_inputs(so)
        cm0, cm1 = inputs.common_attn_metadata[0], inputs.common_attn_metadata[1]
        t0 = clock()
        md = first.build(0, cm0)
        t1 = clock()
        if second.supports_update_block_table:
            second.update_block_table(md, cm1.block_table_tensor, cm1.slot_mapping)
            if i >= 0:
                times["update_block_table"].append(clock() - t1)
        if i >= 0:
            times["build"].append(t1 - t0)
        return inputs

    _replay(workload, steps, dict(reorder_batch_threshold=1), step)
    return {op: _median_us(ns) for op, ns in times.items() if ns}


def scheduled_steady_decode(layer_specs: dict[str, KVCacheSpec], num_reqs: int, num_steps: int,
                            name: str) -> tuple[Workload, KVCacheConfig]:
    """``num_reqs`` requests (prompt lengths cycling ``PROMPT_LENGTHS``) through the real
    ``Scheduler`` until all decode, then ``num_steps`` steady decode steps (nothing finishes).
    The prefill steps are the workload's warm-up."""
    from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
    from attnplug.runner.step.scheduler_output import SamplingParams

    max_model_len, budget = 4096, max(8192, num_reqs)
    groups = group_layers_by_spec(layer_specs, max_layers_per_group=LAYERS_PER_GROUP)
    per_req = cdiv(max(PROMPT_LENGTHS) + num_steps + 1, 16) + 1
    kv = KVCacheConfig(num_reqs * per_req + 16, groups, num_state_slots=num_reqs + 1)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=num_reqs,
                                      max_model_len=max_model_len), kv)
    rng = np.random.default_rng(0)
    for i in range(num_reqs):
        prompt = rng.integers(0, 32000, size=PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]).tolist()
        sched.add_request(f"req-{i}", prompt, SamplingParams(max_tokens=max_model_len))
    steps, warmup = [], None
    while warmup is None or len(steps) < warmup + num_steps:
        out = sched.schedule()
        if warmup is None and len(out.num_scheduled_tokens) == num_reqs and out.total_num_scheduled_tokens == num_reqs:
            warmup = len(steps)
        sampled = {rid: [1] for rid, n in out.num_scheduled_tokens.items()
                   if sched.requests[rid].num_computed_tokens + n >= sched.requests[rid].num_tokens}
        sched.update_from_output(out, sampled)
        steps.append(out)
    config = dict(block_sizes=kv, max_num_reqs=num_reqs, max_model_len=max_model_len, max_num_batched_tokens=budget)
    return Workload(f"{name}: steady decode N={num_reqs}", config, steps, num_warmup=warmup), kv


def time_full_step(workload: Workload, kv: KVCacheConfig, steps: int, attention: str) -> float:
    """One replay: median µs of update_states + prepare_inputs + every group's builder."""
    c = workload.config
    bcfg = BuilderConfig(c["max_num_reqs"], c["max_num_batched_tokens"], c["max_model_len"])
    builders = []
    for g in kv.groups:
        cls = builder_class("mamba2" if g.kv_cache_spec.kind is GroupKind.MAMBA else attention)
        builders.append(cls(g.kv_cache_spec, list(g.layer_names), bcfg, "cpu"))
    group = GroupMetadataBuilder(builders, [list(g.layer_names) for g in kv.groups])
    thresholds = [b.reorder_batch_threshold for b in builders if b.reorder_batch_threshold is not None]
    clock, times = time.perf_counter_ns, []

    def step(i, sc, so):
        t0 = clock()
        sc.update_states(so)
        inputs = sc.prepare_inputs(so)
        group.build(inputs.common_attn_metadata)
        if i >= 0:
            times.append(clock() - t0)
        return inputs

    _replay(workload, steps, dict(reorder_batch_threshold=min(thresholds) if thresholds else None), step)
    return _median_us(times)


def run_builders(sizes: list[int], steps: int, trace_steps: int, repeat: int,
                 backends=BACKENDS) -> list[dict]:
    """The builders rows: one dict per (workload, backend, op) with ``min/median/max`` µs.

    Each repeat replays the workload once per backend (backends interleaved, so all see
    the same minutes of the shared machine)."""
    workloads = [(n, steady_decode(n, steps), steps) for n in sizes]
    if trace_steps > 0:
        workloads.append((None, trace_replay(trace_steps + 10), trace_steps))
    rows = []
    for n, w, k in workloads:
        runs = {b: [] for b in backends}
        for _ in range(repeat):
            for b in backends:
                runs[b].append(time_builders(w, k, b))
        for b in backends:
            for op in runs[b][0]:
                target = BUILDER_TARGETS_US.get((b, n)) if op == "build" else None
                rows.append(dict(workload=w.name, backend=b, op=op, target_us=target,
                                 **spread([r[op] for r in runs[b]])))
    return rows


def run_full_step(sizes: list[int], steps: int, trace_steps: int, repeat: int) -> list[dict]:
    """The full-step rows: tiny-hybrid (3 groups) and the 48-layer hybrid (6 groups)."""
    rows = []
    for layout, specs in (("tiny-hybrid", tiny_hybrid_layer_specs()), ("hybrid-48", hybrid_layer_specs())):
        cases = [(n, *scheduled_steady_decode(specs, n, steps, layout)) for n in sizes]
        if trace_steps > 0:
            hw = hybrid_trace_replay(trace_steps + 10, layer_specs=specs)
            hw.workload.config.setdefault("block_sizes", hw.kv_cache_config)
            cases.append((None, hw.workload, hw.kv_cache_config))
        for n, w, kv in cases:
            runs = {a: [] for a in ("triton", "torch_native")}
            for _ in range(repeat):
                for attention in runs:
                    runs[attention].append(time_full_step(w, kv, steps if n else trace_steps, attention))
            for attention in runs:
                rows.append(dict(workload=w.name if n else f"{layout}: {w.name}", layout=layout,
                                 groups=len(kv.groups), attention=attention,
                                 target_us=FULL_STEP_TARGETS_US.get((layout, attention, n)),
                                 **spread(runs[attention])))
    return rows


def _cell(r: dict) -> str:
    return f"{r['median']:,.1f} ({r['min']:,.1f}–{r['max']:,.1f})"


def _target(r: dict) -> str:
    t = r.get("target_us")
    return "" if t is None else f"{t:.0f} ({'met' if r['median'] <= t else 'missed'})"


def render_builders(builder_rows: list[dict], full_rows: list[dict], markdown: bool) -> str:
    """The two tables as markdown, or printed with ``rich`` (returns "")."""
    h1 = ["workload", "backend", "op", "µs median (min–max)", "target µs"]
    l1 = [[r["workload"], r["backend"], r["op"], _cell(r), _target(r)] for r in builder_rows]
    h2 = ["workload", "groups", "attention", "full step µs median (min–max)", "target µs"]
    l2 = [[r["workload"], str(r["groups"]), r["attention"], _cell(r), _target(r)] for r in full_rows]
    tables = [(h, rows, title) for h, rows, title in (
        (h1, l1, "builders — µs per call"), (h2, l2, "full step — update + prepare + every group's builder"))
        if rows]
    if markdown:
        out = []
        for h, rows, _ in tables:
            out += ["| " + " | ".join(h) + " |", "|" + "---|" * len(h)] + ["| " + " | ".join(c) + " |" for c in rows]
            out.append("")
        return "\n".join(out).rstrip()
    from attnplug.runner.commands.report import Console
    from rich.table import Table

    for h, rows, title in tables:
        table = Table(title=f"attnplug bench step — {title} (1 torch thread)")
        for col in h:
            table.add_column(col, justify="left" if col in ("workload", "backend", "op", "attention") else "right")
        for cells in rows:
            table.add_row(*cells)
        Console().print(table)
    return ""
