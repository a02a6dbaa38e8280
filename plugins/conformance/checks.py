"""The properties the suite checks on a :class:`~attnplug.plugins.conformance.harness.CaseRun`.

Each ``check_*`` returns a list of problems (empty: the property holds); every problem
is a sentence naming the step, cache group, request and position concerned. The test
module prefixes them with the case's name and JSON.
"""

from __future__ import annotations

import numpy as np
import torch

from attnplug.core.contracts import AttentionBackend
from attnplug.plugins.conformance import diagnosis
from attnplug.plugins.conformance.attribution import blocks_read
from attnplug.plugins.conformance.harness import CaseRun, StepRecord
from attnplug.core.kv_quant import quantize_kv
from attnplug.plugins.conformance.cases import ConformanceCase
from attnplug.plugins.conformance.oracle import CaseInputs, case_kv_scales, dense_attention, quantizes_query
from attnplug.plugins.conformance.poison import bits

TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-4),
    "float16": (1e-2, 1e-2),
    "bfloat16": (3e-2, 3e-2),
}
"""``dtype -> (atol, rtol)`` for outputs compared with the reference: a value passes when
``|got - expected| <= atol + rtol * |expected|``."""

MAX_LISTED = 4


def header(run: CaseRun) -> str:
    return (f"case {run.case.name!r} on backend {run.backend_name!r} (device {run.device}, kernel block size "
            f"{run.kernel_block_size})\n  case JSON: {run.case.describe()}")


def _order(step: StepRecord) -> np.ndarray:
    return np.lexsort((step.token_pos, step.token_req))


def _where(step: StepRecord, token: int) -> str:
    return f"request r{int(step.token_req[token])} position {int(step.token_pos[token])}"


def check_outputs(run: CaseRun, reference: CaseRun | None, name_blocks: bool = True) -> list[str]:
    """Every step's output of both cache groups vs ``reference`` (group 0 of the same step),
    or vs the dense float64 oracle when ``reference`` is ``None`` (over the dequantised query
    too, at the bfloat16 tolerance, for a backend that reads fp8 queries:
    ``oracle.quantizes_query``).

    NaN in an output (where the expected value is finite) means the backend read a block
    that held NaN (``poison.py``); the first such step and group names the blocks read
    (``attribution.py``, by rerunning the case) unless ``name_blocks`` is False.
    """
    quant_q = quantizes_query(run.backend, run.case)
    atol, rtol = max(TOLERANCES[run.case.dtype], TOLERANCES["bfloat16"]) if quant_q else TOLERANCES[run.case.dtype]
    inputs = CaseInputs(run.case, quantized_query=quant_q) if reference is None else None
    problems = []
    named_nan = False
    for s, step in enumerate(run.steps):
        order = _order(step)
        if reference is None:
            expected = dense_attention(inputs, step.token_req[order], step.token_pos[order])
        else:
            ref_step = reference.steps[s]
            expected = ref_step.groups[0].output[_order(ref_step)].double()
        for g, grp in enumerate(step.groups):
            got = grp.output[order].double()
            diff = (got - expected).abs()
            bad = ~(diff <= atol + rtol * expected.abs())  # NaN counts as bad
            if not bad.any():
                continue
            n_bad = int(bad.sum())
            worst = torch.nan_to_num(diff, nan=float("inf")).flatten().argmax()
            t, h, d = np.unravel_index(int(worst), tuple(diff.shape))
            token = int(order[t])
            kind = "checked step" if step.checked else "history step"
            n_nan = int((torch.isnan(got) & ~torch.isnan(expected)).sum())
            if n_nan:
                against = "dense float64 oracle" if reference is None else "torch_native reference"
                problems.append(_nan_problem(run, s, kind, g, n_nan, bad.numel(), named_nan or not name_blocks,
                                             against))
                named_nan = True
                continue
            wrote_nothing = len(step.token_req) and torch.equal(bits(grp.cache_after), bits(grp.cache_before))
            problems.append(
                f"step {s} ({kind}), cache group {g}: {n_bad} of {bad.numel()} output values differ from the "
                f"{'dense float64 oracle' if reference is None else 'torch_native reference'} beyond atol={atol} "
                f"rtol={rtol}; worst at {_where(step, token)} head {h} dim {d}: got {float(got[t, h, d]):.6g}, "
                f"expected {float(expected[t, h, d]):.6g}"
                + ("; the step wrote none of its slots (see test_kv_written_exactly_at_slot_mapping)"
                   if wrote_nothing else "")
                + diagnosis.poison_sentence(got, bad)
                + diagnosis.heads_sentence(run, step.token_req[order], step.token_pos[order], got, bad,
                                           (atol, rtol)))
    return problems


def _nan_problem(run: CaseRun, s: int, kind: str, g: int, n_nan: int, total: int, named: bool,
                 against: str) -> str:
    """The problem of a step whose output holds NaN; names the blocks read unless ``named``."""
    head = f"step {s} ({kind}), cache group {g}: output values differ from the {against}: {n_nan} of {total} are NaN"
    if named:
        return head + " (blocks read: see the first NaN step above)"
    text = (head + ": the backend read KV-cache blocks no query of the step may read (the null block, spare "
            "blocks, other requests' blocks and freed sliding-window blocks hold NaN; a read that is masked "
            "afterwards still gives 0 * NaN)")
    found, complete = blocks_read(run, s, g)
    if not found:
        return text + "; no single poisoned block explains it (the NaN may come from the backend itself)"
    listed = "; ".join(found[:2 * MAX_LISTED]) + (" ..." if len(found) > 2 * MAX_LISTED else "")
    return text + f". Blocks read ({len(found)}{'' if complete else ', maybe more'}): " + listed


def _expected_cache(backend: type[AttentionBackend], step: StepRecord, g: int, kbs: int,
                    case: ConformanceCase) -> torch.Tensor:
    grp = step.groups[g]
    expected = grp.cache_before.clone()
    n = len(step.token_req)
    slots = grp.slot_mapping[:n]
    kc, vc = backend.split_kv_cache(expected)
    k_scale, v_scale = case_kv_scales(case)  # fp8: saturate(x / scale) (core/kv_quant.py)
    kc[slots // kbs, slots % kbs] = quantize_kv(step.key[:n], k_scale, kc.dtype)
    vc[slots // kbs, slots % kbs] = quantize_kv(step.value[:n], v_scale, vc.dtype)
    return expected


def check_cache_writes(run: CaseRun, backend: type[AttentionBackend]) -> list[str]:
    """K/V of every real token lands exactly at its ``slot_mapping`` entry, and no other
    byte of the (poisoned) cache changes: not for padded tokens, not anywhere else."""
    kbs = run.kernel_block_size
    problems = []
    for s, step in enumerate(run.steps):
        n = len(step.token_req)
        for g, grp in enumerate(step.groups):
            expected = _expected_cache(backend, step, g, kbs, run.case)
            if torch.equal(bits(grp.cache_after), bits(expected)):
                continue
            if n and torch.equal(bits(grp.cache_after), bits(grp.cache_before)):
                problems.append(
                    f"step {s}, cache group {g}: the step wrote none of its {n} slots: forward() left the KV cache "
                    "exactly as it was. Its K/V write landed in a temporary, not in kv_cache: e.g. reshape() or "
                    ".contiguous() of a strided cache view (the default split_kv_cache() views are strided) "
                    "returns a copy; index the view in place, e.g. key_cache[block, offset] = key")
                continue
            slot_of_token = {int(x): t for t, x in enumerate(grp.slot_mapping[:n].tolist())}
            missing, stray = [], []
            for half, (got_v, exp_v) in zip("KV", zip(backend.split_kv_cache(grp.cache_after),
                                                    backend.split_kv_cache(expected))):
                differs = (bits(got_v) != bits(exp_v)).flatten(2).any(dim=2)  # [num_blocks, block_size]
                for blk, off in torch.nonzero(differs).tolist():
                    slot = blk * kbs + off
                    if slot in slot_of_token:
                        t = slot_of_token[slot]
                        missing.append(f"{half} at slot {slot} should hold the {half} of token {t} "
                                       f"({_where(step, t)}) but does not")
                    else:
                        stray.append(f"{half} at slot {slot} (block {blk}, offset {off})")
            parts = []
            if missing:
                parts.append(f"{len(missing)} real slot(s) do not hold their token's K/V: "
                             + "; ".join(missing[:MAX_LISTED]) + (" ..." if len(missing) > MAX_LISTED else ""))
            if stray:
                parts.append(f"{len(stray)} slot(s) changed although no real token maps to them (a padded "
                             "token's write, or a stray write): "
                             + "; ".join(stray[:MAX_LISTED]) + (" ..." if len(stray) > MAX_LISTED else ""))
            if not parts:
                parts.append("bytes outside the split_kv_cache() views changed")
            problems.append(f"step {s}, cache group {g}: the KV cache after forward() is not the cache before with "
                            "exactly the real tokens' K/V written at slot_mapping. " + " | ".join(parts))
    return problems


def check_metadata_untouched(run: CaseRun) -> list[str]:
    """Builders never mutate the ``CommonAttentionMetadata`` (nor ``update_block_table`` the
    metadata) they are given."""
    return [f"step {s}: {m}" for s, step in enumerate(run.steps) for m in step.mutations]


def check_update_block_table(run: CaseRun) -> list[str] | None:
    """``update_block_table`` equals a fresh ``build`` (``None``: the builder does not support it)."""
    if all(step.update_vs_fresh is None for step in run.steps):
        return None
    return [f"step {s}: update_block_table() result differs from a fresh build(): {d}"
            for s, step in enumerate(run.steps) for d in (step.update_vs_fresh or [])]


def check_same_runs(first: CaseRun, second: CaseRun) -> list[str]:
    """Two runs of the same case are bit-identical (outputs and caches)."""
    problems = []
    for s, (a, b) in enumerate(zip(first.steps, second.steps)):
        for g, (ga, gb) in enumerate(zip(a.groups, b.groups)):
            if not torch.equal(ga.output.view(torch.uint8) if ga.output.is_contiguous() else ga.output,
                               gb.output.view(torch.uint8) if gb.output.is_contiguous() else gb.output):
                problems.append(f"step {s}, cache group {g}: outputs of two identical runs differ "
                                f"(max |diff| {float((ga.output.double() - gb.output.double()).abs().max()):.3g})")
            if not torch.equal(bits(ga.cache_after), bits(gb.cache_after)):
                problems.append(f"step {s}, cache group {g}: KV caches of two identical runs differ")
    return problems
