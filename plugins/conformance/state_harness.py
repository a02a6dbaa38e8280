"""Run one state case on one state backend (any kind) through the real runner path, and record it.

Per step: ``SchedulerOutput`` -> ``StepCompiler.update_states`` -> ``prepare_inputs`` ->
the builder's ``build`` (group 0) / ``update_block_table`` (group 1) -> the impl's
``forward``, on two state cache groups with the same spec and different state slots. The
spec, layer config, inputs and reference come from the backend's ``state_kind``
(``state_kinds.py``): the spec declares the kind's tensors and the backend allocates them
(``allocate_state_cache``); poison, copies and records go over every declared tensor.

Every slot starts as NaN (the null slot 0, spare slots, and the slots of requests not
admitted yet: a new request's slot holds a previous owner's stale state, which it must
zero, never read); a preempted request's slot is poisoned again when it is freed.
Padded tokens carry inputs of ``PAD_INPUT`` and ``PAD_SLOT_ID`` rows; the output starts
as ``OUTPUT_SENTINEL``. The record keeps, per step and group, the output rows, every
state tensor before and after ``forward``, and which slot each request held.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

from attnplug.cache_groups.kinds import GroupKind
from attnplug.core.contracts import AttentionBackend, BuilderConfig
from attnplug.core.devices import resolve_device
from attnplug.plugins.conformance.requirements import torch_dtype
from attnplug.plugins.conformance.snapshots import changes_since, snapshot
from attnplug.plugins.conformance.state_cases import StateCase
from attnplug.plugins.conformance.state_hybrid import HybridBook
from attnplug.plugins.conformance.state_kinds import kind_of
from attnplug.plugins.conformance.state_oracle import StateInputs, request_plan

PAD_INPUT = -777.0
OUTPUT_SENTINEL = -555.0
NUM_GROUPS = 2


@dataclass
class StateGroupStep:
    """One cache group's part of a step (CPU tensors)."""

    output: torch.Tensor
    """``[num_padded_tokens, *kind.output_shape]``, the case dtype (padded rows included)."""
    names: tuple[str, ...]
    """The declared state tensors' names (``StateSpec.tensors``)."""
    before: tuple[torch.Tensor, ...]
    """Each state tensor ``[num_slots, *shape]`` before ``forward``."""
    after: tuple[torch.Tensor, ...]
    """... and after it (a verifying row: after the runner's commit)."""
    slots: dict[int, int]
    """``{request index: its state slot}`` for the step's requests."""
    scratch: set[int] = field(default_factory=set)
    """Scratch slots the step may write besides ``slots`` (verifying rows' draft positions)."""


@dataclass
class StateStep:
    index: int
    token_req: np.ndarray
    """``[num_actual_tokens]`` request index of each token."""
    token_pos: np.ndarray
    """``[num_actual_tokens]`` position of each token in its request."""
    computed_after: dict[int, int]
    """Per scheduled request, tokens computed after the step (a verifying row: ``1 +
    accepted`` more)."""
    checked: np.ndarray | None = None
    """``[num_actual_tokens]`` bool: tokens whose output the reference covers (``False``:
    rejected drafts, fed other inputs)."""
    groups: list[StateGroupStep] = field(default_factory=list)
    mutations: list[str] = field(default_factory=list)
    update_vs_fresh: list[str] | None = None


@dataclass
class StateRun:
    case: StateCase
    backend_name: str
    device: str
    state_kind: str = "mamba2"
    steps: list[StateStep] = field(default_factory=list)
    error: str | None = None


class _StateRunner:
    def __init__(self, backend_cls: type[AttentionBackend], case: StateCase, device: str):
        from attnplug.runner.step.compiler import StepCompiler
        from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

        self._types = (CachedRequestData, NewRequestData, SchedulerOutput)
        self.case, self.device = case, resolve_device(device)
        self.kind = kind = kind_of(backend_cls)
        lcfg = kind.layer_config(case, str(self.device))
        lens, self.prompt_lens, self.starts = request_plan(case)
        self.book = HybridBook(case, NUM_GROUPS)
        per_req = self.book.slots_per_request
        self.max_len = max(lens) + per_req   # a request holds up to computed + 1 tokens; drafts after them
        resumes = len(case.preempt)
        num_slots = 1 + (case.num_requests + resumes) * per_req + len(case.prefix_hits) + case.spare_slots
        rng = np.random.default_rng(case.seed * 31 + 5)
        # slot ids per group: a permutation of 1 .. num_slots - 2 (the last slot stays spare)
        self.pools = [list(rng.permutation(np.arange(1, num_slots - 1))) for _ in range(NUM_GROUPS)]
        self.slot: list[dict[int, int]] = [{} for _ in range(NUM_GROUPS)]
        self.scratch: list[dict[int, list[int]]] = [{} for _ in range(NUM_GROUPS)]
        bs = max(1, self.max_len // per_req)   # the block table then has >= 1 + drafts columns
        spec = kind.spec(case, bs)
        self.names = tuple(t.name for t in spec.tensors)
        max_tokens = max(sum(n for _, n in st) for st in case.steps) + case.num_pad_tokens
        cfg = BuilderConfig(max_num_reqs=case.num_requests, max_num_batched_tokens=max_tokens,
                            max_model_len=self.max_len)
        builder_cls = backend_cls.get_builder_cls()
        self.builders = [builder_cls(spec, [f"mamba{g}"], cfg, self.device) for g in range(NUM_GROUPS)]
        self.compiler = StepCompiler(
            [bs] * NUM_GROUPS, max_num_reqs=case.num_requests, max_model_len=self.max_len,
            max_num_batched_tokens=max_tokens, device=self.device, kernel_block_sizes=[bs] * NUM_GROUPS,
            reorder_batch_threshold=builder_cls.reorder_batch_threshold, num_blocks=num_slots,
            group_kinds=[GroupKind.MAMBA] * NUM_GROUPS, validate=True)
        self.impl = backend_cls.get_impl_cls()(lcfg)
        self.states = [backend_cls.allocate_state_cache(spec, num_slots, self.device) for _ in range(NUM_GROUPS)]
        for st in self.states:
            for t in st:
                t.fill_(float("nan"))
        self.inputs = StateInputs(case, self.device, kind)
        self.lens = lens
        self.computed = list(self.starts)
        self.held = list(self.prompt_lens)
        self.admitted: set[int] = set()
        self.resuming: set[int] = set()

    def _take_slots(self, r: int) -> tuple[list[int], ...]:
        """The request's ``slots_per_request`` slots per group: its own, then scratch ones."""
        k = self.book.slots_per_request
        for g in range(NUM_GROUPS):
            ids = [int(self.pools[g].pop(0)) for _ in range(k)]
            self.slot[g][r], self.scratch[g][r] = ids[0], ids[1:]
        return tuple([self.slot[g][r]] + self.scratch[g][r] for g in range(NUM_GROUPS))

    def scheduler_output(self, index: int, step):
        CachedRequestData, NewRequestData, SchedulerOutput = self._types
        for s, r in self.case.preempt:
            if s == index and r in self.admitted:
                for g in range(NUM_GROUPS):   # the freed slots: poisoned as if reused by another request
                    for x in [self.slot[g][r]] + self.scratch[g][r]:
                        for t in self.states[g]:
                            t[x] = float("nan")
                self.computed[r] = 0
                self.resuming.add(r)
        new, cached = [], CachedRequestData()
        for r, _ in step:
            if r not in self.admitted:
                new.append(NewRequestData(req_id=f"r{r}", prompt_token_ids=[1] * self.prompt_lens[r],
                                          block_ids=self._take_slots(r), num_computed_tokens=self.starts[r]))
                self.admitted.add(r)
                continue
            resumed = r in self.resuming
            self.resuming.discard(r)
            cached.req_ids.append(f"r{r}")
            cached.resumed_from_preemption.append(resumed)
            cached.new_token_ids.append([])
            cached.new_block_ids.append(self._take_slots(r) if resumed else None)
            cached.num_computed_tokens.append(self.computed[r])
        return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                               num_scheduled_tokens={f"r{r}": n for r, n in step},
                               scheduled_spec_decode_tokens={f"r{r}": [1] * (dict(step)[r] - 1)
                                                             for r in self.book.verifying(index)})

    def run_step(self, index: int, step) -> StateStep:
        case, sc = self.case, self.compiler
        so = self.scheduler_output(index, step)
        sc.update_states(so)
        Q = so.total_num_scheduled_tokens
        inputs = sc.prepare_inputs(so, num_tokens_padded=Q + case.num_pad_tokens if case.num_pad_tokens else None)
        rows = inputs.req_indices[:Q]
        token_req = np.asarray([int(inputs.req_ids[r][1:]) for r in range(inputs.num_reqs)], dtype=np.int64)[rows]
        token_pos = inputs.positions_cpu[:Q].numpy().astype(np.int64)
        P = inputs.num_padded_tokens
        dtype = torch_dtype(case.dtype)
        ins = [torch.full((P, w), PAD_INPUT, dtype=dtype) for w in self.kind.input_widths(case)]
        rejected = self.book.rejected_positions(index, step, self.computed)
        checked = np.ones(Q, dtype=bool)
        for t, (r, p) in enumerate(zip(token_req.tolist(), token_pos.tolist())):
            src = self.inputs.fields[r]
            if (r, p) in rejected:   # a rejected draft: other inputs, no reference output
                src, checked[t] = self.inputs.rejected[r], False
            for x, f in zip(ins, src):
                x[t] = f[p]
        ins = [x.to(self.device) for x in ins]
        verifying = self.book.verifying(index)
        for r, n in step:
            self.computed[r] += n if r not in verifying else 1 + verifying[r]
        record = StateStep(index, token_req, token_pos, {r: self.computed[r] for r, _ in step}, checked)
        self.book.restore_hits(self, so)   # prefix hits: the checkpoint into the request's slot
        cms = inputs.common_attn_metadata
        snaps = [snapshot(cm) for cm in cms]
        b0, b1 = self.builders
        md0 = b0.build(0, cms[0])
        md1_fresh = b1.build(0, cms[1])
        md1 = md1_fresh
        if b1.supports_update_block_table:
            md0_snap = snapshot(md0)
            md1 = b1.update_block_table(md0, cms[1].block_table_tensor, cms[1].slot_mapping)
            record.mutations += [f"update_block_table() mutated the metadata it was given: {d}"
                                 for d in changes_since(md0, md0_snap)]
            record.update_vs_fresh = []
        for g, cm in enumerate(cms):
            record.mutations += [f"build()/update_block_table() mutated CommonAttentionMetadata.{d} (group {g})"
                                 for d in changes_since(cm, snaps[g])]
        out_shape = self.kind.output_shape(case)
        for g, md in enumerate((md0, md1)):
            st = self.states[g]
            before = tuple(t.clone() for t in st)
            out = torch.full((P, *out_shape), OUTPUT_SENTINEL, dtype=dtype, device=self.device)
            self.impl.forward(self.inputs.layer, *ins, st, md, out)
            scratch = {x for r in verifying for x in self.scratch[g][r][:dict(step)[r] - 1]}
            record.groups.append(StateGroupStep(out.cpu(), self.names, tuple(t.cpu() for t in before),
                                                tuple(t.cpu().clone() for t in st),
                                                {r: self.slot[g][r] for r, _ in step}, scratch))
            if g == 1 and md1 is not md1_fresh:
                fresh_state = type(st)(*(t.clone() for t in before))
                fresh_out = torch.full_like(out, OUTPUT_SENTINEL)
                self.impl.forward(self.inputs.layer, *ins, fresh_state, md1_fresh, fresh_out)
                same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                           for a, b in [(fresh_out, out), *zip(fresh_state, st)])
                if not same:
                    record.update_vs_fresh.append("forward() with update_block_table() metadata differs from "
                                                  "forward() with a fresh build()")
        self.book.finish_step(self, index, step, record)   # commit drafts, append tokens, save checkpoints
        return record


def run_state_case(backend_cls: type[AttentionBackend], case: StateCase, device: str) -> StateRun:
    """Run ``case`` on ``backend_cls``; a backend's exception goes to ``StateRun.error``."""
    kind = kind_of(backend_cls)
    run = StateRun(case, backend_cls.get_name(), device, kind.state_kind if kind else "")
    index = -1
    try:
        runner = _StateRunner(backend_cls, case, device)
        for index, step in enumerate(case.steps):
            run.steps.append(runner.run_step(index, step))
    except Exception:
        run.error = f"{'setting up the case' if index < 0 else f'step {index}'}: {traceback.format_exc()}"
    return run
