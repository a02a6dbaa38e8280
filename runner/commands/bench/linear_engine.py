"""``attnplug bench linear --engine``: the whole engine with the direct oneDNN linears on and off,
side by side in one process.

One model is built once (``bench engine``'s loading, float32); each run is ``bench engine``'s own
attnplug run (a fresh engine over that model, EOS ignored, the same requests and limits) with
``cpu_linear.use_direct(True)`` (oneDNN's C API) or ``(False)`` (torch's op). Both are warmed up
once, then ``rounds`` rounds run both, the order swapped every round so a load spike on the
shared machine hits both alike. Reported per model: the median forward ms/step and generated
tokens/s of each, the median of the rounds' forward-time ratios torch op ÷ direct (> 1: the
direct path is faster) with every round's ratio, how many linears each path's runs held
packed for the direct path (``direct_linears``: all of them, then none; every measured run starts
with the caches emptied, :func:`clear_packed`, so it counts its own and pays its own packing, as
each run did while the two paths shared one cache entry per weight), the outputs digests (the two paths must
produce the same tokens: else exit status 1), the torch thread count and the load averages.
"""

from __future__ import annotations

import os
import statistics

import torch


def engine_ab(model_name: str, threads: int, rounds: int, engine_argv: list[str]) -> dict:
    """One model's row (module docstring); ``engine_argv``: ``bench engine`` flags for the
    workload (``--num-requests``, ``--output-len``, limits)."""
    from attnplug.runner.commands.assemble import build_engine, resolve_backend
    from attnplug.runner.commands.bench import engine as bench_engine
    from attnplug.runner.commands.model_loading import load_model_for_run
    from attnplug.runner.models import cpu_linear

    args = bench_engine._parser().parse_args(["--model", model_name, *engine_argv])  # noqa: SLF001
    run_args = bench_engine._run_args(args, model_name)  # noqa: SLF001
    model = load_model_for_run(run_args.model, backend=run_args.backend, block_size=run_args.block_size,
                               seed=run_args.seed, resolve=resolve_backend, dtype=torch.float32)
    model = build_engine(run_args, requests=False, model=model).model
    load_start = os.getloadavg()[0]
    runs: dict[bool, list[dict]] = {True: [], False: []}
    ratios = []
    try:
        for direct in (True, False):  # warm-up
            cpu_linear.use_direct(direct)
            bench_engine._attnplug_run(run_args, model, threads)  # noqa: SLF001
        for r in range(rounds):
            got = {}
            for direct in ((True, False) if r % 2 == 0 else (False, True)):
                cpu_linear.use_direct(direct)
                clear_packed(model)  # each run packs for its own path, as when the two paths shared an entry
                got[direct] = bench_engine._attnplug_run(run_args, model, threads)  # noqa: SLF001
                got[direct]["direct_linears"] = direct_linears(model)
                runs[direct].append(got[direct])
            ratios.append(_forward_ms(got[False]) / _forward_ms(got[True]))
    finally:
        cpu_linear.use_direct()
    return {"model": model_name, "torch_threads": torch.get_num_threads(), "rounds": rounds,
            "num_requests": args.num_requests, "output_len": args.output_len,
            "forward_ms_direct": statistics.median(_forward_ms(o) for o in runs[True]),
            "forward_ms_torch_op": statistics.median(_forward_ms(o) for o in runs[False]),
            "tokens_per_s_direct": statistics.median(_tokens_per_s(o) for o in runs[True]),
            "tokens_per_s_torch_op": statistics.median(_tokens_per_s(o) for o in runs[False]),
            "ratio_forward_torch_op_to_direct": statistics.median(ratios), "round_ratios": ratios,
            "digest_direct": sorted({o["outputs_digest"] for o in runs[True]}),
            "digest_torch_op": sorted({o["outputs_digest"] for o in runs[False]}),
            "load_average_1m": [load_start, os.getloadavg()[0]],
            "direct_linears": [max(o["direct_linears"] for o in runs[True]), max(o["direct_linears"] for o in runs[False])]}


def clear_packed(model: torch.nn.Module) -> None:
    """Empty every ``packed_weights`` cache of ``model`` (``cpu_linear``: the torch-op and the
    direct path each keep an entry per weight), so the next run's :func:`direct_linears`
    counts only what that run packed."""
    for m in model.modules():
        cache = m.__dict__.get("packed_weights")
        if cache is not None:
            cache.clear()


def direct_linears(model: torch.nn.Module) -> int:
    """How many of ``model``'s packed linear weights are held by the direct path (a
    ``_onednn.Matmul``) rather than as torch's packed tensor: which path the last run took."""
    return sum(type(entry[2]).__name__ == "Matmul" for m in model.modules()
               for entry in m.__dict__.get("packed_weights", {}).values())


def _forward_ms(run: dict) -> float:
    return 1e3 * run["forward_s"] / run["steps"]


def _tokens_per_s(run: dict) -> float:
    return run["generated_tokens"] / run["wall_s"]


def same_outputs(row: dict) -> bool:
    """Both paths made one and the same digest over all their runs."""
    return len(row["digest_direct"]) == 1 and row["digest_direct"] == row["digest_torch_op"]


def render(rows: list[dict]) -> str:
    """The markdown table."""
    lines = ["| model | workload | torch threads | forward ms/step direct / torch op | tok/s direct / torch op | "
             "torch op ÷ direct, forward (rounds) | load 1 min start / end | digest |",
             "|---|---|---:|---|---|---|---|---|"]
    for r in rows:
        rounds = ", ".join(f"{x:.2f}" for x in r["round_ratios"])
        digest = r["digest_direct"][0][:8] + "…" if same_outputs(r) else "DIFFERENT"
        lines.append(f"| {r['model']} | {r['num_requests']} × {r['output_len']} | {r['torch_threads']} | "
                     f"{r['forward_ms_direct']:.2f} / {r['forward_ms_torch_op']:.2f} | "
                     f"{r['tokens_per_s_direct']:,.0f} / {r['tokens_per_s_torch_op']:,.0f} | "
                     f"**{r['ratio_forward_torch_op_to_direct']:.3f}** ({rounds}) | "
                     f"{r['load_average_1m'][0]:.2f} / {r['load_average_1m'][1]:.2f} | {digest} |")
    return "\n".join(lines)


__all__ = ["clear_packed", "direct_linears", "engine_ab", "render", "same_outputs"]
