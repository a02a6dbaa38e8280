"""``attnplug bench threads``: the same ``attnplug run`` workload at several torch thread counts,
interleaved in one process, so the thread default (``runner/commands/threads.py``) is judged
against one thread under the machine's load of the moment (docs/performance.md, "Torch threads").

Every flag it does not know goes to ``attnplug run``'s parser (model, requests, limits; the
default is ``attnplug run``'s default, SmolLM2 on 8 bundled prompts). ``--counts 1,2,default``
lists the thread counts; ``default`` is what ``attnplug run`` would choose at the start (the
thread policy, flags and variables included), resolved once. Each of ``--repeat`` rounds runs
every count once on a fresh engine over the same model, the order rotated by one per round
(so no count always runs first or after the same neighbour). The table gives, per count, the
median (min–max) wall seconds of the measured run, the median forward ms per step, generated
tokens/s, and the median over rounds of the wall ratio to the first count of that round's
run — the figure side by side. Every run must produce the same ``outputs_digest``; otherwise
exit status 1. ``--json`` prints the figures, the load averages and the thread counts.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from attnplug.core.errors import AttnplugError
from attnplug.runner.commands import threads
from attnplug.runner.commands.limits import OneLineParser, bounded_int


def parse_counts(text: str) -> list[str]:
    """``--counts``: comma-separated thread counts (ints in ``[1, MAX_THREADS]``) or ``default``;
    raises ``ValueError`` (one line) otherwise or when empty."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError("--counts needs at least one thread count")
    for x in items:
        if x != "default":
            threads._parse(x, "--counts")  # noqa: SLF001 (the same check as the flag)
    return items


def _one_run(run_args, model, n: int) -> dict:
    from attnplug.runner.commands import replay, serving_flags
    from attnplug.runner.commands.assemble import build_engine

    torch.set_num_threads(n)
    load = os.getloadavg()[0]
    setup = build_engine(run_args, model=model)
    m = replay.measure(setup, serving_flags.plan(run_args, setup))
    s = m.summary
    return {"torch_threads": torch.get_num_threads(), "wall_s": m.wall_s, "load_average_1m": load,
            "forward_ms_per_step": s["median_us_per_step"]["forward"] / 1e3,
            "generated_tokens_per_s": s["generated_tokens_per_s"], "outputs_digest": s["outputs_digest"],
            "model": setup.model}


def _row(label: str, runs: list[dict], ratios: list[float]) -> dict:
    walls = [r["wall_s"] for r in runs]
    return {"count": label, "torch_threads": runs[0]["torch_threads"], "runs": len(runs),
            "wall_s": {"min": min(walls), "median": statistics.median(walls), "max": max(walls)},
            "forward_ms_per_step": statistics.median(r["forward_ms_per_step"] for r in runs),
            "generated_tokens_per_s": statistics.median(r["generated_tokens_per_s"] for r in runs),
            "wall_ratio_to_first": statistics.median(ratios),
            "load_average_1m": [r["load_average_1m"] for r in runs]}


def render(report: dict) -> str:
    """The markdown table of a :func:`main` report."""
    first = report["counts"][0]
    lines = [f"| threads | wall s, median (min-max) | forward ms/step | generated tok/s | wall / {first} |",
             "|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        w = r["wall_s"]
        lines.append(f"| {r['count']} ({r['torch_threads']}) | {w['median']:.2f} ({w['min']:.2f}-{w['max']:.2f}) | "
                     f"{r['forward_ms_per_step']:.1f} | {r['generated_tokens_per_s']:.1f} | "
                     f"{r['wall_ratio_to_first']:.2f} |")
    lines.append(f"\n{report['repeat']} rounds, order rotated; CPUs usable: {report['usable_cpus']}; load average "
                 f"at start / end: {report['load_start'][0]:.2f} / {report['load_end'][0]:.2f}; "
                 f"outputs identical: {report['outputs_identical']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``attnplug bench threads [--counts 1,2,default] [--repeat N] [--json] [attnplug run flags]``"""
    from attnplug.runner.commands import real_run, serving_flags
    from attnplug.runner.commands.run import _parser as run_parser

    p = OneLineParser(prog="attnplug bench threads", description=__doc__.splitlines()[0],
                      epilog="Every other flag is `attnplug run`'s (--model, --num-requests, --output-len, ...).")
    p.add_argument("--counts", default="1,2,default",
                   help="thread counts (ints) or 'default' (what `attnplug run` would choose now), comma-separated; "
                        "the first is the reference (default 1,2,default)")
    p.add_argument("--repeat", type=bounded_int(1, 100), default=3, help="rounds (each runs every count once)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of the table")
    args, rest = p.parse_known_args(argv)
    run_args = run_parser().parse_args(rest)  # unknown flags: one line from run's parser, exit 2
    try:
        labels = parse_counts(args.counts)
        default, _ = threads.resolve(run_args.torch_threads, os.environ)
    except ValueError as e:
        print(f"attnplug bench threads: {e}", file=sys.stderr)
        return 2
    why = real_run.resolve_defaults(run_args) or serving_flags.check(run_args)
    if why is not None:
        print(f"attnplug bench threads: {why}", file=sys.stderr)
        return 2
    counts = [default if x == "default" else int(x) for x in labels]
    load_start, model, before = list(os.getloadavg()), None, torch.get_num_threads()
    runs: list[list[dict]] = [[] for _ in labels]
    ratios: list[list[float]] = [[] for _ in labels]
    try:
        for r in range(args.repeat):
            this_round = {}
            for j in range(len(labels)):
                i = (j + r) % len(labels)
                this_round[i] = _one_run(run_args, model, counts[i])
                model = this_round[i].pop("model")
                runs[i].append(this_round[i])
            for i in this_round:
                ratios[i].append(this_round[i]["wall_s"] / this_round[0]["wall_s"])
    except AttnplugError as e:
        print(f"attnplug bench threads: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(before)
    digests = {r["outputs_digest"] for rs in runs for r in rs}
    report = {"counts": labels, "repeat": args.repeat, "usable_cpus": threads.usable_cpus(),
              "load_start": load_start, "load_end": list(os.getloadavg()), "outputs_identical": len(digests) == 1,
              "model": run_args.model, "num_requests": run_args.num_requests,
              "rows": [_row(lab, rs, rt) for lab, rs, rt in zip(labels, runs, ratios)]}
    print(json.dumps(report, indent=1) if args.json else render(report))
    if len(digests) != 1:
        print("attnplug bench threads: the thread counts generated different tokens (outputs_digest differs)",
              file=sys.stderr)
        return 1
    return 0
