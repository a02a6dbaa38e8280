"""The hybrid-state part of a state case run: verifying rows and prefix-cache hits.

:class:`HybridBook` keeps what ``state_harness`` needs beyond plain prefill/decode steps,
and does it with the runner's own functions, so the family checks a backend on the path
the engine takes:

* **drafts** (``StateCase.verify``): each request holds ``1 + max drafts`` slots per group
  (slot 0 its state, then scratch slots: ``KVCacheConfig.state_slots_per_request``);
  after the forward the runner's :func:`~attnplug.runner.step.spec_apply.draft_state_copies`
  picks the accepted column and it is copied into slot 0, as
  ``runner/execute/spec_decode/state_commit.py`` does; the
  emitted tokens are appended (``StepCompiler.append_verified_tokens``), so the next step
  sees the rolled-back ``num_computed_tokens`` and one real token left;
* **prefix hits** (``StateCase.prefix_hits``): when the source has computed exactly
  ``tokens``, its slot (every declared tensor) is copied into a checkpoint slot (a *save*); the hit request is
  admitted with ``num_computed_tokens = tokens`` and the checkpoint is copied into its own
  slot before its first forward (a *restore*), every state tensor's row ``src`` into row
  ``dst``, as ``runner/execute/state_copies.py`` does (``plugins.conformance`` may not
  import ``runner.execute``: docs/architecture.md).
"""

from __future__ import annotations

import torch

from attnplug.plugins.conformance.state_cases import StateCase


def copy_slots(states, copies) -> None:
    """``(g, src, dst)``: row ``src`` of every state tensor of group ``g`` into row ``dst``."""
    for g, src, dst in copies:
        for t in states[g]:
            t[dst].copy_(t[src])


class HybridBook:
    """Per run: the case's verifying rows, checkpoints and the tokens each request holds.

    Args:
        case: the state case.
        num_groups: cache groups of the run.
    """

    def __init__(self, case: StateCase, num_groups: int):
        self.case, self.num_groups = case, num_groups
        self._verify: dict[int, dict[int, int]] = {}
        drafts = 0
        for s, r, a in case.verify:
            self._verify.setdefault(s, {})[r] = a
            drafts = max(drafts, dict(case.steps[s])[r] - 1)
        self.slots_per_request = 1 + drafts
        self.checkpoints: dict[tuple[int, int], list[int]] = {}
        """``{(source, tokens): [checkpoint slot per group]}``."""

    def verifying(self, step: int) -> dict[int, int]:
        """``{request: accepted drafts}`` of the step's verifying rows."""
        return self._verify.get(step, {})

    def rejected_positions(self, step: int, scheduled, computed: list[int]) -> set[tuple[int, int]]:
        """``(request, position)`` of the step's rejected drafts (before ``computed`` advances)."""
        n_of = dict(scheduled)
        out = set()
        for r, a in self.verifying(step).items():
            c = computed[r]
            out.update((r, p) for p in range(c + 1 + a, c + n_of[r]))
        return out

    def restore_hits(self, runner, so) -> None:
        """Before the forward: each hit admitted in ``so`` gets its checkpoint copied into its slot."""
        for nr in so.scheduled_new_reqs:
            r = int(nr.req_id[1:])
            for hr, src, h in self.case.prefix_hits:
                if hr != r:
                    continue
                ckpt = self.checkpoints.get((src, h))
                if ckpt is None:
                    raise ValueError(f"prefix hit {(hr, src, h)}: request r{src} never computed exactly {h} "
                                     "tokens at the end of a step (no checkpoint to restore)")
                copy_slots(runner.states, [(g, ckpt[g], runner.slot[g][r]) for g in range(self.num_groups)])

    def finish_step(self, runner, index: int, step, record) -> None:
        """After the forward: commit the verifying rows' accepted states (and record the
        slots after it), append the emitted tokens, save the checkpoints hits will need."""
        from attnplug.runner.step.spec_apply import draft_state_copies

        sc = runner.compiler
        rows_of = sc.input_batch.req_id_to_index
        verifying = self.verifying(index)
        if verifying:
            tables = [sc.input_batch.block_table[g].block_table_np for g in range(self.num_groups)]
            rows = [rows_of[f"r{r}"] for r in verifying]
            copies = draft_state_copies(tables, rows, [[1] * (a + 1) for a in verifying.values()])
            for g, (src, dst) in enumerate(copies):
                for t in runner.states[g]:
                    t.index_copy_(0, torch.as_tensor(dst, device=t.device),
                                  t.index_select(0, torch.as_tensor(src, device=t.device)))
                record.groups[g].after = tuple(t.cpu().clone() for t in runner.states[g])
        done = [(r, runner.computed[r] + 1 - runner.held[r]) for r, _ in step if runner.computed[r] >= runner.held[r]]
        if done:
            sc.append_verified_tokens([rows_of[f"r{r}"] for r, _ in done], [[1] * k for _, k in done])
            for r, _ in done:
                runner.held[r] = runner.computed[r] + 1
        for _, src, h in self.case.prefix_hits:
            if src in dict(step) and runner.computed[src] == h and (src, h) not in self.checkpoints:
                ckpt = [int(runner.pools[g].pop(0)) for g in range(self.num_groups)]
                copy_slots(runner.states, [(g, runner.slot[g][src], ckpt[g]) for g in range(self.num_groups)])
                self.checkpoints[(src, h)] = ckpt
