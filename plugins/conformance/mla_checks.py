"""The MLA family's checks: each returns the problems it found (empty: passed), every
line naming the case, so a failure says which property of which step broke.

Used by ``test_mla_conformance.py`` (``attnplug check``) and by the planted-bug tests.
"""

from __future__ import annotations

import torch

from attnplug.plugins.conformance.mla_cases import ABSORB_CASE, CHUNK_CASE, REENTRANT_CASES, MLACase, fitted
from attnplug.plugins.conformance.mla_harness import OUTPUT_SENTINEL, TOLERANCE, MLARun, MLAStep, reference_output
from attnplug.plugins.conformance.snapshots import rows_written_outside


def _close(case: MLACase, what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> list[str]:
    if torch.isnan(got).any():
        rows = torch.isnan(got).flatten(1).any(1).nonzero().flatten().tolist()
        return [f"case {case.name!r}: {what}: NaN in token rows {rows[:8]}: the backend read a poisoned cache row "
                "(a block no query may read, e.g. the null block, or past a request's seq_len)"]
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    if err > TOLERANCE[dtype] * scale:
        worst = int((got.double() - want.double()).abs().flatten(1).max(1).values.argmax())
        return [f"case {case.name!r}: {what}: max abs error {err:.3g} > {TOLERANCE[dtype] * scale:.3g} "
                f"(worst token row {worst})"]
    return []


def check_outputs(step: MLAStep, run: MLARun) -> list[str]:
    """Real rows equal the float64 expanded reference; padded rows keep the sentinel."""
    case, t = run.case, sum(run.case.num_scheduled_tokens)
    problems = _close(case, "output vs the expanded float64 reference", run.output[:t], reference_output(step.inp),
                      step.dtype)
    pad = run.output[t:]
    if pad.numel() and not bool((pad == OUTPUT_SENTINEL).all()):
        problems.append(f"case {case.name!r}: padded output rows {t}..{run.output.shape[0] - 1} were written")
    return problems


def check_cache(run: MLARun) -> list[str]:
    """Each real token's slot holds exactly ``[kv_c_normed | k_pe]``; no other row changed."""
    case = run.case
    before = run.cache_before.view(-1, run.cache_before.shape[-1])
    after = run.cache_after.view(-1, run.cache_after.shape[-1])
    t = sum(case.num_scheduled_tokens)
    slots = run.slot_mapping[:t]
    problems = []
    bad = (after[slots] != run.new_rows).any(1).nonzero().flatten().tolist()
    if bad:
        lr = case.kv_lora_rank
        tok = bad[0]
        latent_ok = torch.equal(after[slots[tok], :lr], run.new_rows[tok, :lr])
        part = "the k_pe (rope) part" if latent_ok else "the latent (kv_c_normed) part"
        problems.append(f"case {case.name!r}: latent rows of tokens {bad[:8]} differ from [kv_c_normed | k_pe] at "
                        f"their slot_mapping slots (first difference in {part})")
    rows = rows_written_outside(before, after, slots)
    if rows:
        problems.append(f"case {case.name!r}: cache rows {rows[:8]} not in slot_mapping were written")
    return problems


def check_absorbed_equals_expanded(backend_cls, device: str) -> list[str]:
    """The same decodes through ``forward_mqa`` (absorbed) and ``forward_mha`` (expanded)."""
    step = MLAStep(backend_cls, fitted(ABSORB_CASE, backend_cls), device)
    mqa, mha = step.run(), step.run(threshold=0)
    if mqa.num_decodes != ABSORB_CASE.num_reqs or mha.num_decodes != 0:
        return [f"case {ABSORB_CASE.name!r}: the builder put {mqa.num_decodes} rows in decode with threshold 1 and "
                f"{mha.num_decodes} with threshold 0 (expected {ABSORB_CASE.num_reqs} and 0)"]
    return _close(ABSORB_CASE, "absorbed decode (forward_mqa) vs expanded prefill (forward_mha)", mqa.output,
                  mha.output, step.dtype) + _close(ABSORB_CASE, "absorbed decode vs the reference", mqa.output,
                                                   reference_output(step.inp), step.dtype)


def check_chunked_equals_one_shot(backend_cls, device: str) -> list[str]:
    """Context gathered through a 3-row workspace (many chunks) == in one chunk."""
    step = MLAStep(backend_cls, fitted(CHUNK_CASE, backend_cls), device)
    tiny, whole = step.run(), step.run(workspace_tokens=4096)
    if tiny.num_chunks < 2 or whole.num_chunks != 1:
        return [f"case {CHUNK_CASE.name!r}: expected several context chunks with workspace_tokens="
                f"{CHUNK_CASE.workspace_tokens} and one with 4096, got {tiny.num_chunks} and {whole.num_chunks}"]
    return _close(CHUNK_CASE, "chunked-context prefill vs one-shot", tiny.output, whole.output, step.dtype) + \
        _close(CHUNK_CASE, "chunked-context prefill vs the reference", tiny.output, reference_output(step.inp),
               step.dtype)


def check_reentrant(backend_cls, device: str) -> list[str]:
    """One builder builds N steps before any forward: each equals its own build + forward."""
    steps = [MLAStep(backend_cls, fitted(c, backend_cls), device) for c in REENTRANT_CASES]
    most = max(c.num_reqs for c in REENTRANT_CASES)
    shared = steps[0].builder(most, max_num_reqs=most)
    metas = [shared.build(0, s.cm) for s in steps]
    problems = []
    for s, md in zip(steps, metas):
        late = s.forward(md, s.cache.clone()).cpu()
        alone = s.forward(steps[0].builder(most, max_num_reqs=most).build(0, s.cm), s.cache.clone()).cpu()
        if not torch.equal(late.nan_to_num(), alone.nan_to_num()):
            problems.append(f"case {s.case.name!r}: built before {len(steps) - 1} other builds and run after them, "
                            "the output differs from a build right before its forward (the builder keeps "
                            "per-step state)")
    return problems
