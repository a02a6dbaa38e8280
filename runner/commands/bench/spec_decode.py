"""``attnplug bench step``'s speculative-decoding table: the step compiler with drafts.

Workload (:func:`spec_decode_workload`): ``N`` live requests (prompts cached but their last
token, lengths cycling through ``workloads.PROMPT_LENGTHS``), two cache groups, block size
16; every steady step each request verifies ``k`` drafts (``1 + k`` scheduled tokens,
``scheduled_spec_decode_tokens``), blocks allocated for the optimistic length, and then
emits ``a + 1`` tokens with ``a`` drawn uniformly from ``0 .. k`` (seeded), its
``num_computed_tokens`` advancing by ``a + 1`` in the next step's delta (the rollback).
The same ``N`` without drafts (one token per request and step) runs beside it. Both hand
the cached requests' drafts and block appends in the form attnplug's scheduler sends
(``form="packed"``: ``SchedulerOutput.packed_cached``, arrays aligned with ``req_ids``), or in
vLLM's (``form="vllm"``: ``scheduled_spec_decode_tokens`` and ``new_block_ids`` lists;
``--spec-form vllm``). Every step's output is built before the first is timed.

Timed per step: ``update_states`` (the drafts of a regular step are checked by the
kernels' cached scan, ``runner/step/kernels.py``), ``prepare_inputs`` (including
``SpecDecodeMetadata``, laid out by the kernels) and the common metadata; appending the
emitted tokens (``append_verified_tokens``) is not timed, as in the other tables. Columns: our compiler (compiled paths where the step allows) and
the numpy paths only, interleaved, best of ``--repeat``; "with / without drafts" is ours'
update + prepare with ``k`` drafts over the same requests without (issue 30's target:
at most 1.5 at N = 256 and 1024).
"""

from __future__ import annotations


import numpy as np

from attnplug.runner.commands.bench.timing import render_stage_table, timed_compile
from attnplug.runner.commands.bench.workloads import PROMPT_LENGTHS
from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.scheduler_output import (
    CachedRequestData, NewRequestData, PackedCachedDeltas, SchedulerOutput)

STAGES = ("update_states", "prepare_inputs", "common metadata")
"""The timed stages (as ``bench/step.py``'s table)."""


def best_run(runs: list[dict]) -> dict:
    """The replay with the lowest median total ("best of N", as ``timeit``)."""
    return min(runs, key=lambda r: r["total"])


def spec_decode_workload(num_reqs: int, num_steps: int, k: int, block_size: int = 16, num_groups: int = 2,
                         seed: int = 0, form: str = "packed"
                         ) -> tuple[dict, list[SchedulerOutput], list[dict[str, list[int]]]]:
    """``(compiler config, steps, emitted tokens per step)`` (see the module docstring);
    ``k = 0`` is the same workload without drafts. Step 0 admits everyone (warm-up).
    ``form``: ``"packed"`` or ``"vllm"`` (the steady steps' drafts and appends)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 32000, size=L).tolist() for L in PROMPT_LENGTHS]
    nxt = [1] * num_groups
    info: dict[str, list[int]] = {}  # req_id -> [num_computed_tokens, num_blocks]
    new = []
    for i in range(num_reqs):
        p = prompts[i % len(prompts)]
        nb = -(-len(p) // block_size)
        blocks = []
        for g in range(num_groups):
            blocks.append(list(range(nxt[g], nxt[g] + nb)))
            nxt[g] += nb
        new.append(NewRequestData(f"req-{i}", p, tuple(blocks), len(p) - 1))
        info[f"req-{i}"] = [len(p) - 1, nb]
    steps = [SchedulerOutput(new, CachedRequestData(), {r.req_id: 1 for r in new})]
    emitted = [{r.req_id: [1] for r in new}]
    packed = form == "packed"
    for _ in range(num_steps):
        cached, spec, out = CachedRequestData(), {}, {}
        if packed:  # built as arrays directly, as attnplug's scheduler would hand them
            counts, starts = np.zeros((num_groups, num_reqs), np.int32), np.zeros((num_groups, num_reqs), np.int64)
        for j, (rid, st) in enumerate(info.items()):
            ncc, n = st[0] + len(emitted[-1][rid]), 1 + k
            st[0] = ncc
            need = -(-(ncc + n) // block_size) - st[1]
            blocks = None
            if need > 0:
                if packed:
                    counts[:, j], starts[:, j] = need, nxt
                else:
                    blocks = tuple(list(range(nxt[g], nxt[g] + need)) for g in range(num_groups))
                nxt = [x + need for x in nxt]
                st[1] += need
            cached.req_ids.append(rid)
            cached.resumed_from_preemption.append(False)
            cached.new_token_ids.append([])
            cached.new_block_ids.append(blocks)
            cached.num_computed_tokens.append(ncc)
            if k and not packed:
                spec[rid] = [7] * k
            out[rid] = [5] * (int(rng.integers(0, k + 1)) + 1)
        nst = dict.fromkeys(cached.req_ids, 1 + k)
        if packed:
            ids = [np.arange(s, s + c, dtype=np.int32) for g in range(num_groups)
                   for s, c in zip(starts[g].tolist(), counts[g].tolist()) if c]
            pk = PackedCachedDeltas(np.full(num_reqs, k, np.int32), np.full(num_reqs * k, 7, np.int32), counts,
                                    np.concatenate(ids) if ids else np.zeros(0, np.int32))
            steps.append(SchedulerOutput([], cached, nst, packed_cached=pk))
        else:
            steps.append(SchedulerOutput([], cached, nst, scheduled_spec_decode_tokens=spec))
        emitted.append(out)
    config = dict(block_sizes=[block_size] * num_groups, max_num_reqs=num_reqs, max_model_len=8192,
                  max_num_batched_tokens=max(2048, num_reqs * (1 + k)), num_blocks=1 << 28)
    return config, steps, emitted


def time_spec(config: dict, steps: list, emitted: list, native: bool | None) -> dict[str, float]:
    """One replay; median µs per stage over the steady steps (step 0 is warm-up)."""
    cfg = dict(config)
    sc = StepCompiler(cfg.pop("block_sizes"), validate=False, native=native, **cfg)
    times = np.zeros((len(steps) - 1, len(STAGES)), dtype=np.int64)
    for i, so in enumerate(steps):
        inputs, ns = timed_compile(sc, so)
        if i:
            times[i - 1] = ns
        rows = np.flatnonzero(~inputs.discard)
        toks = [emitted[i][inputs.req_ids[r]] for r in rows.tolist()]
        if inputs.spec_decode_metadata is not None:
            sc.append_verified_tokens(rows, toks)
        else:
            sc.append_output_tokens(rows, [t[0] for t in toks])
    t = times / 1e3
    out = {s: float(np.median(t[:, j])) for j, s in enumerate(STAGES)}
    out["update + prepare"] = float(np.median(t[:, 0] + t[:, 1]))
    out["total"] = float(np.median(t.sum(axis=1)))
    return out


def run_spec(num_reqs: int, k: int, num_steps: int, repeat: int, numpy_column: bool,
             form: str = "packed") -> list[dict]:
    """Rows ``{"workload", "form", "ours", "numpy_path", "ratio"}`` for ``k`` drafts and for none
    (both in ``form``, :func:`spec_decode_workload`); the
    replays of the two workloads (and of both columns) interleaved so that they see the
    same machine weather. ``ratio``: ours' update + prepare with drafts over without."""
    loads = [(kk, spec_decode_workload(num_reqs, num_steps, kk, form=form)) for kk in (k, 0)]
    runs: dict[int, list] = {kk: [] for kk, _ in loads}
    for _ in range(max(1, repeat)):
        for kk, w in loads:
            runs[kk].append((time_spec(*w, None), time_spec(*w, False) if numpy_column else None))
    rows = []
    for kk, _ in loads:
        name = f"spec decode N={num_reqs}, k={kk}" if kk else f"same without drafts N={num_reqs}"
        rows.append({"workload": name, "form": form, "ours": best_run([r[0] for r in runs[kk]]),
                     "numpy_path": best_run([r[1] for r in runs[kk]]) if numpy_column else None})
    ratio = rows[0]["ours"]["update + prepare"] / rows[1]["ours"]["update + prepare"]
    rows[0]["ratio"], rows[1]["ratio"] = ratio, None
    return rows


def render_spec(rows: list[dict], markdown: bool) -> str:
    """The table (markdown text, or printed with rich and "" returned)."""
    header = ["workload", "stage", "ours µs", "numpy path µs", "with / without drafts"]
    lines = [[r["workload"] if s == STAGES[0] else "", s, f"{r['ours'][s]:,.1f}",
              f"{r['numpy_path'][s]:,.1f}" if r["numpy_path"] else "-",
              f"{r['ratio']:.2f}" if s == "update + prepare" and r.get("ratio") else ""]
             for r in rows for s in (*STAGES, "update + prepare", "total")]
    form = rows[0].get("form", "packed") if rows else "packed"
    return render_stage_table(f"attnplug bench step — speculative decoding ({form} drafts and appends), "
                              "median µs per step (1 torch thread)",
                              header, lines, markdown)
