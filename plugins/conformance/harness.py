"""Run one case on one backend through the real runner path, and record everything.

Per step: ``SchedulerOutput`` -> ``StepCompiler.update_states`` -> ``prepare_inputs``
(which builds the ``CommonAttentionMetadata`` of every cache group) -> the backend's
builder ``build`` -> impl ``forward``, exactly as ``ModelRunner`` does, on two cache
groups with the same spec but different (permuted) block ids, so that
``update_block_table`` can be compared with a fresh ``build``.

The KV caches start *poisoned*: before every step, each block no query of the step may
read (the null block, spare blocks, blocks of requests not yet admitted, freed
sliding-window blocks: ``poison.py``) holds NaN, so any read of one, masked or not,
shows in the output; a request's own blocks get a large finite value when it is
admitted, and its keys no query of the step can see are re-poisoned with it. The record
keeps, per step and group: the output rows, the cache before and after ``forward``, the
slot mapping, the NaN blocks and why, the metadata mutations observed, and the
update-vs-fresh comparison.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec, cdiv
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import AttentionBackend, AttentionType, BuilderConfig
from attnplug.core.devices import resolve_device
from attnplug.plugins.conformance.cases import ConformanceCase
from attnplug.plugins.conformance.oracle import CaseInputs, alibi_slopes, case_kv_scales, case_q_scale
from attnplug.plugins.conformance.poison import PoisonPlan, bits
from attnplug.plugins.conformance.requirements import torch_dtype
from attnplug.plugins.conformance.snapshots import changes_since, snapshot, value_differences

POISON = 1000.0
"""Value of a request's unwritten and out-of-window slots; reading it unmasked ruins the output."""
PAD_INPUT = -777.0
"""Value of the query/key/value rows of padded tokens; writing it anywhere is visible."""
NUM_GROUPS = 2


@dataclass
class GroupStep:
    """One cache group's part of a step (all tensors on CPU)."""

    output: torch.Tensor
    """``[num_actual_tokens, num_heads, head_size]``, the case dtype."""
    cache_before: torch.Tensor
    cache_after: torch.Tensor
    slot_mapping: torch.Tensor
    """``[num_padded_tokens]`` int64, as the runner produced it."""


@dataclass
class StepRecord:
    """Everything observed in one step."""

    index: int
    checked: bool
    """True for the case's checked step (the last); False for history steps."""
    token_req: np.ndarray
    """``[num_actual_tokens]`` request index (into ``case.requests``) of each token."""
    token_pos: np.ndarray
    """``[num_actual_tokens]`` position of each token in its request."""
    key: torch.Tensor
    """``[num_padded_tokens, num_kv_heads, head_size]`` CPU, the step's keys (incl. padding)."""
    value: torch.Tensor
    groups: list[GroupStep] = field(default_factory=list)
    mutations: list[str] = field(default_factory=list)
    update_vs_fresh: list[str] | None = None
    """``None`` when the builder does not support ``update_block_table``; else differences."""
    poisoned: list[dict[int, str]] = field(default_factory=list)
    """Per cache group, ``{kernel block id: why}`` of the blocks that held NaN in the step."""


@dataclass
class CaseRun:
    """A finished run, or the error that stopped it (``error`` holds the traceback text)."""

    case: ConformanceCase
    backend_name: str
    device: str
    kernel_block_size: int
    steps: list[StepRecord] = field(default_factory=list)
    error: str | None = None
    backend: type[AttentionBackend] | None = None
    """The backend class (to rerun the case when a failure needs it)."""


def case_cache_dtype(case: ConformanceCase) -> torch.dtype:
    """The KV cache's dtype: the case's ``dtype``, or its fp8 ``kv_cache_dtype``."""
    from attnplug.core.kv_quant import parse_kv_cache_dtype

    return parse_kv_cache_dtype(case.kv_cache_dtype) or torch_dtype(case.dtype)


def case_layer(case: ConformanceCase, device) -> SimpleNamespace | None:
    """The ``layer`` argument of ``forward``: ``None``, or for an fp8 case an object with
    the case's ``k_scale`` / ``v_scale`` (``oracle.case_kv_scales``) and ``q_scale``
    (``oracle.case_q_scale``, read by backends that quantize the query) on ``device``."""
    if case.kv_cache_dtype == "auto":
        return None
    k_scale, v_scale = case_kv_scales(case)
    return SimpleNamespace(k_scale=k_scale.to(device), v_scale=v_scale.to(device),
                           q_scale=case_q_scale(case).to(device))


def _assign_blocks(case: ConformanceCase, num_blocks_needed: list[int], group: int) -> tuple[list[list[int]], int]:
    """Manager block ids per request for one group, and the pool size (null block + spares)."""
    total = sum(num_blocks_needed)
    num_blocks = 1 + total + case.spare_blocks
    ids = np.arange(1, num_blocks)
    if case.block_order == "permuted":
        ids = np.random.default_rng(case.seed * 31 + group).permutation(ids)
    out, at = [], 0
    for n in num_blocks_needed:
        out.append([int(b) for b in ids[at:at + n]])
        at += n
    return out, num_blocks


def schedule(case: ConformanceCase) -> list[dict[int, int]]:
    """Per step, ``{request index: tokens scheduled}``: history chunks, then the checked step."""
    chunk = case.history_chunk
    done = [0] * len(case.requests)
    steps = []
    while any(d < c for d, (c, _) in zip(done, case.requests)):
        step = {}
        for i, (c, _) in enumerate(case.requests):
            if done[i] < c:
                step[i] = min(c - done[i], chunk or c)
                done[i] += step[i]
        steps.append(step)
    steps.append({i: s for i, (_, s) in enumerate(case.requests)})
    return steps


def _kernel_slots(blocks: list[int], positions: np.ndarray, block_size: int, kbs: int) -> np.ndarray:
    """Flat kernel slots of ``positions`` of a request owning manager ``blocks``."""
    k = block_size // kbs
    manager = np.asarray(blocks, dtype=np.int64)[positions // block_size]
    kernel_block = manager * k + (positions % block_size) // kbs
    return kernel_block * kbs + positions % kbs


class _Runner:
    """State of one run: the step compiler, builders, impl and caches of both groups."""

    def __init__(self, backend_cls: type[AttentionBackend], case: ConformanceCase, device: str, kbs: int,
                 nan_only: frozenset[tuple[int, int]] | None = None):
        from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
        from attnplug.runner.step.compiler import StepCompiler

        self._types = (CachedRequestData, NewRequestData, SchedulerOutput)
        self.backend, self.case, self.device, self.kbs = backend_cls, case, resolve_device(device), kbs
        dtype = torch_dtype(case.dtype)
        lens = [c + s for c, s in case.requests]
        needed = [cdiv(n, case.block_size) for n in lens]
        self.blocks, num_blocks = zip(*(_assign_blocks(case, needed, g) for g in range(NUM_GROUPS)))
        num_blocks = num_blocks[0]
        self.steps = schedule(case)
        max_tokens = max(sum(s.values()) for s in self.steps) + case.num_pad_tokens
        max_model_len = cdiv(max(lens), case.block_size) * case.block_size
        if case.sliding_window is not None:
            spec = SlidingWindowSpec(block_size=kbs, num_kv_heads=case.num_kv_heads, head_size=case.head_size,
                                     dtype=case_cache_dtype(case), sliding_window=case.sliding_window)
        else:
            spec = FullAttentionSpec(block_size=kbs, num_kv_heads=case.num_kv_heads, head_size=case.head_size,
                                     dtype=case_cache_dtype(case))
        cfg = BuilderConfig(max_num_reqs=len(lens), max_num_batched_tokens=max_tokens, max_model_len=max_model_len,
                            dtype=dtype)
        builder_cls = backend_cls.get_builder_cls()
        self.builders = [builder_cls(spec, [f"layer{g}"], cfg, self.device) for g in range(NUM_GROUPS)]
        self.compiler = StepCompiler(
            [case.block_size] * NUM_GROUPS, max_num_reqs=len(lens), max_model_len=max_model_len,
            max_num_batched_tokens=max_tokens, device=self.device, kernel_block_sizes=[kbs] * NUM_GROUPS,
            reorder_batch_threshold=builder_cls.reorder_batch_threshold, num_blocks=num_blocks,
            group_kinds=[spec.kind] * NUM_GROUPS, validate=True, sliding_windows=[case.sliding_window] * NUM_GROUPS)
        self.inputs = CaseInputs(case)
        sink_kwargs = {} if self.inputs.sinks is None else {"sinks": self.inputs.sinks.to(self.device)}
        if case.alibi:  # only to backends that declare ALiBi (requirements.assess skips the others)
            sink_kwargs["alibi_slopes"] = alibi_slopes(case).to(self.device)
        self.impl = backend_cls.get_impl_cls()(
            case.num_heads, case.head_size, case.softmax_scale, case.num_kv_heads, sliding_window=case.sliding_window,
            logits_soft_cap=case.logits_soft_cap, attn_type=AttentionType.DECODER,
            kv_cache_dtype=case_cache_dtype(case), **sink_kwargs)
        shape = backend_cls.get_kv_cache_shape(num_blocks * (case.block_size // kbs), kbs, case.num_kv_heads,
                                               case.head_size)
        cache_dtype = case_cache_dtype(case)
        self.poison_value = min(POISON, torch.finfo(cache_dtype).max)  # finite in an fp8 cache too
        self.caches = [torch.full(shape, self.poison_value, dtype=cache_dtype, device=self.device)
                       for _ in range(NUM_GROUPS)]
        self.layer = case_layer(case, self.device)
        self.plan = PoisonPlan(case, self.blocks, num_blocks, self.steps, kbs)
        self.nan_only = nan_only
        """``None``: every planned block gets NaN; else only these ``(group, kernel block)``
        (the others get ``POISON``), to find which blocks a failing backend reads."""
        self.admitted: set[int] = set()
        self.computed = [0] * len(lens)

    def scheduler_output(self, step: dict[int, int]):
        CachedRequestData, NewRequestData, SchedulerOutput = self._types
        new, cached = [], CachedRequestData()
        for i, n in step.items():
            c, s = self.case.requests[i]
            if i not in self.admitted:
                prompt_len = c if (s == 1 and c > 0) else c + s
                new.append(NewRequestData(req_id=f"r{i}", prompt_token_ids=[1] * prompt_len,
                                          block_ids=tuple(list(self.blocks[g][i]) for g in range(NUM_GROUPS))))
                self.admitted.add(i)
            else:
                cached.req_ids.append(f"r{i}")
                cached.resumed_from_preemption.append(False)
                cached.new_token_ids.append([])
                cached.new_block_ids.append(None)
                cached.num_computed_tokens.append(self.computed[i])
        return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                               num_scheduled_tokens={f"r{i}": n for i, n in step.items()})

    def poison(self, index: int, step: dict[int, int]) -> list[dict[int, str]]:
        """Poison the caches before step ``index`` (module docstring); returns, per group,
        the NaN blocks and why."""
        W, nan = self.case.sliding_window, float("nan") if self.caches[0].is_floating_point() else POISON
        planned = []
        for g in range(NUM_GROUPS):
            halves = self.backend.split_kv_cache(self.caches[g])
            fresh = [kb for i in self.plan.admitted_at(index) for b in self.blocks[g][i]
                     for kb in self.plan.kernel_blocks(b)]
            for half in halves:
                half[torch.as_tensor(fresh, dtype=torch.int64, device=self.device)] = self.poison_value
            for i in step if W is not None else ():
                hidden = np.arange(max(0, self.computed[i] - W + 1))
                slots = torch.as_tensor(_kernel_slots(self.blocks[g][i], hidden, self.case.block_size, self.kbs),
                                        device=self.device)
                for half in halves:
                    half[slots // self.kbs, slots % self.kbs] = self.poison_value
            blocks = self.plan.nan_blocks(index, g, self.computed)
            if self.nan_only is not None:
                blocks = {kb: why for kb, why in blocks.items() if (g, kb) in self.nan_only}
            ids = torch.as_tensor(sorted(blocks), dtype=torch.int64, device=self.device)
            for half in halves:
                half[ids] = nan
            planned.append(blocks)
        return planned

    def run_step(self, index: int, step: dict[int, int]) -> StepRecord:
        case, sc = self.case, self.compiler
        so = self.scheduler_output(step)
        poisoned = self.poison(index, step)
        sc.update_states(so)
        Q = so.total_num_scheduled_tokens
        inputs = sc.prepare_inputs(so, num_tokens_padded=Q + case.num_pad_tokens if case.num_pad_tokens else None)
        rows = inputs.req_indices[:Q]
        token_req = np.asarray([int(inputs.req_ids[r][1:]) for r in range(inputs.num_reqs)], dtype=np.int64)[rows]
        token_pos = inputs.positions_cpu[:Q].numpy().astype(np.int64)
        self._check_runner_slots(inputs, token_req, token_pos)

        P = inputs.num_padded_tokens
        table_rows = self.inputs.rows(token_req, token_pos)
        q, k, v = (self._padded(t[table_rows], P) for t in (self.inputs.query, self.inputs.key, self.inputs.value))
        record = StepRecord(index, index == len(self.steps) - 1, token_req, token_pos, k.cpu(), v.cpu(),
                            poisoned=poisoned)

        cms = inputs.common_attn_metadata
        snaps = [snapshot(cm) for cm in cms]
        b0, b1 = self.builders
        md0 = b0.build(0, cms[0])
        record.mutations += [f"build() mutated CommonAttentionMetadata.{d}" for d in changes_since(cms[0], snaps[0])]
        if b1.supports_update_block_table:
            md0_snap = snapshot(md0)
            md1 = b1.update_block_table(md0, cms[1].block_table_tensor, cms[1].slot_mapping)
            record.mutations += [f"update_block_table() mutated the metadata it was given: {d}"
                                 for d in changes_since(md0, md0_snap)]
            md1_fresh = b1.build(0, cms[1])
            record.update_vs_fresh = [f"field {d}" for d in value_differences(md1, md1_fresh)]
        else:
            md1 = md1_fresh = b1.build(0, cms[1])
        record.mutations += [f"build()/update_block_table() mutated CommonAttentionMetadata.{d} (group 1)"
                             for d in changes_since(cms[1], snaps[1])]

        for g, md in enumerate((md0, md1)):
            before = self.caches[g].clone()
            out = torch.zeros(P, case.num_heads, case.head_size, dtype=q.dtype, device=self.device)
            self._forward(q, k, v, self.caches[g], md, out)
            record.groups.append(GroupStep(out[:Q].cpu().clone(), before.cpu(), self.caches[g].cpu().clone(),
                                           cms[g].slot_mapping.cpu().clone()))
            if g == 1 and md1_fresh is not md1:
                fresh_cache = before.clone()
                fresh_out = torch.zeros_like(out)
                self._forward(q, k, v, fresh_cache, md1_fresh, fresh_out)
                if not (torch.equal(bits(fresh_out[:Q]), bits(out[:Q]))
                        and torch.equal(bits(fresh_cache), bits(self.caches[g]))):
                    record.update_vs_fresh.append("forward() with update_block_table() metadata differs from "
                                                  "forward() with a fresh build()")
        keep = [inputs.req_ids[r] for r in np.flatnonzero(~np.asarray(inputs.discard))]
        if keep and not record.checked:
            sc.append_output_tokens(keep, [[1]] * len(keep))
        for i, n in step.items():
            self.computed[i] += n
        return record

    def _forward(self, q, k, v, kv_cache, md, out) -> None:
        """``impl.forward``; on CUDA under ``torch.cuda.set_sync_debug_mode("error")``, so a
        forward that synchronises with the host (``.item()``, ``.tolist()``...) fails."""
        if self.device.type != "cuda":
            self.impl.forward(self.layer, q, k, v, kv_cache, md, out)
            return
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self.impl.forward(self.layer, q, k, v, kv_cache, md, out)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def _padded(self, t: torch.Tensor, P: int) -> torch.Tensor:
        if P > t.shape[0]:
            pad = torch.full((P - t.shape[0], *t.shape[1:]), PAD_INPUT, dtype=t.dtype)
            t = torch.cat([t, pad])
        return t.to(self.device)

    def _check_runner_slots(self, inputs, token_req: np.ndarray, token_pos: np.ndarray) -> None:
        """The runner's slot mapping must match the blocks the case handed out (harness sanity)."""
        Q = inputs.num_actual_tokens
        for g in range(NUM_GROUPS):
            got = inputs.slot_mapping[g][:inputs.num_padded_tokens].cpu().numpy()
            want = np.empty(Q, dtype=np.int64)
            for i in np.unique(token_req):
                sel = token_req == i
                want[sel] = _kernel_slots(self.blocks[g][i], token_pos[sel], self.case.block_size, self.kbs)
            if not (np.array_equal(got[:Q], want) and (got[Q:] == PAD_SLOT_ID).all()):
                raise AssertionError(f"harness: the runner's slot_mapping for group {g} {got.tolist()} does not "
                                     f"match the case's blocks {want.tolist()}; this is a runner bug")


def run_case(backend_cls: type[AttentionBackend], case: ConformanceCase, device: str, kbs: int, *,
             nan_only: frozenset[tuple[int, int]] | None = None, stop_after: int | None = None) -> CaseRun:
    """Run ``case`` on ``backend_cls`` (on ``device``, kernel block size ``kbs``).

    ``nan_only`` limits the NaN poison to those ``(cache group, kernel block)`` pairs (the
    other planned blocks get the finite ``POISON``); ``stop_after`` ends the run after that
    step. Both serve :mod:`~attnplug.plugins.conformance.attribution`.

    Never raises for a backend's error: the traceback goes to ``CaseRun.error`` (with the
    step it happened in), and every check of the case then fails with it.
    """
    run = CaseRun(case, backend_cls.get_name(), device, kbs, backend=backend_cls)
    step_index = -1
    try:
        runner = _Runner(backend_cls, case, device, kbs, nan_only)
        for step_index, step in enumerate(runner.steps):
            run.steps.append(runner.run_step(step_index, step))
            if stop_after is not None and step_index >= stop_after:
                break
    except Exception:
        where = "setting up the case" if step_index < 0 else f"step {step_index}"
        run.error = f"{where}: {traceback.format_exc()}"
    return run


__all__ = ["CaseRun", "GroupStep", "StepRecord", "run_case", "schedule", "POISON", "PAD_INPUT"]
