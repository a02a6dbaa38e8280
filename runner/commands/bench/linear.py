"""``attnplug bench linear``: one CPU linear call, torch's oneDNN op against oneDNN's C API directly.

The two paths of ``runner/models/cpu_linear.py`` on the same float32 weight and input: torch's
``mkldnn._linear_pointwise`` on a weight packed by ``_reorder_linear_weight`` (``torch op``),
and the direct path (``runner/models/onednn.py``: oneDNN 3.2's matmul primitive, cached per row
count, called through the C API), each through ``cpu_linear.linear`` itself — its checks,
the output allocation and the cache look-up included, as the forward calls it. The shapes are
a model's decode linears (``--model``: ``tiny-llama`` and other presets, or ``smollm2``; its
HF config): the fused q/k/v projection, ``o_proj``, the fused gate/up projection,
``down_proj`` and the LM head, each at every ``--rows`` (rows = requests in a decode step).

Each case is timed in ``--rounds`` rounds; a round times ``--iters`` calls of each path after
``--warmup`` (median µs), the path that goes first alternating by round, so a load spike on the
shared machine hits both alike. Reported per case: the median over rounds of each path's µs per
call, their difference, and the median of the rounds' direct ÷ torch ratios (< 1: the direct
path is faster); the two outputs must be equal bitwise (else exit status 1; the largest
difference is printed). ``--threads`` sets torch's (and so oneDNN's) thread count; the table
records it and the load averages. ``--json`` prints the figures as JSON instead of the table.
Without the direct path (no ``onednn-cpu-gomp`` wheel, ``ATTNPLUG_ONEDNN_DIRECT=0``) it exits 2
saying why.

``--engine`` times the whole engine instead, the direct path on and off side by side in one
process (``bench/linear_engine.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from attnplug.runner.commands.bench.median_time import median_us
from attnplug.runner.commands.limits import OneLineParser, bounded_int


def decode_shapes(config: dict) -> list[tuple[str, int, int]]:
    """``(name, out_features N, in_features K)`` of a Llama-family model's linears, from its HF
    ``config`` (``head_dim`` defaulting to ``hidden_size / num_attention_heads``)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    return [("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden), ("o_proj", hidden, heads * head_dim),
            ("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter), ("lm_head", vocab, hidden)]


def time_case(n: int, k: int, rows: int, rounds: int, iters: int, warmup: int) -> dict:
    """One shape: both paths through ``cpu_linear.linear``, alternating first by round."""
    from attnplug.runner.models import cpu_linear

    gen = torch.Generator().manual_seed(n * 131 + k)
    weight = torch.randn(n, k, generator=gen) / k ** 0.5
    x = torch.randn(rows, k, generator=gen)
    holders = {False: torch.nn.Module(), True: torch.nn.Module()}  # each path's own packed cache
    cpu_linear.use_direct()
    module = cpu_linear._DIRECT[0]  # noqa: SLF001 (set per timed block below, not per call)
    torch_us, direct_us, ratios = [], [], []
    try:
        with torch.no_grad():
            out = {}
            for direct in (False, True):
                cpu_linear._DIRECT[0] = module if direct else None  # noqa: SLF001
                out[direct] = cpu_linear.linear(x, weight, None, holders[direct])
            diff = (out[True] - out[False]).abs().max().item()
            for r in range(rounds):
                got = {}
                for direct in ((False, True) if r % 2 == 0 else (True, False)):
                    cpu_linear._DIRECT[0] = module if direct else None  # noqa: SLF001
                    got[direct] = median_us(lambda h=holders[direct]: cpu_linear.linear(x, weight, None, h),
                                            iters, warmup)
                torch_us.append(got[False])
                direct_us.append(got[True])
                ratios.append(got[True] / got[False])
    finally:
        cpu_linear._DIRECT[0] = module  # noqa: SLF001
    t, d = statistics.median(torch_us), statistics.median(direct_us)
    return {"rows": rows, "out_features": n, "in_features": k, "torch_op_us": t, "direct_us": d,
            "saved_us": t - d, "ratio_direct_to_torch": statistics.median(ratios), "max_abs_diff": diff}


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="attnplug bench linear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama,smollm2",
                        help="comma-separated: presets (tiny-llama, ...) and/or smollm2")
    parser.add_argument("--rows", default="16,64", help="comma-separated row counts (decode batch sizes), each >= 1")
    parser.add_argument("--threads", type=bounded_int(1, 256), default=1, help="torch threads")
    parser.add_argument("--rounds", type=bounded_int(1, 1000), default=5)
    parser.add_argument("--iters", type=bounded_int(1, 10**6), default=200, help="timed calls per path and round")
    parser.add_argument("--warmup", type=bounded_int(0, 10**6), default=20)
    parser.add_argument("--engine", action="store_true",
                        help="time the whole engine with the direct path on and off instead (bench/linear_engine.py; "
                             "--model, --threads, --rounds; --num-requests/--output-len as bench engine's)")
    parser.add_argument("--num-requests", type=bounded_int(1, 4096), default=64, help="--engine: requests")
    parser.add_argument("--output-len", type=bounded_int(1, 4096), default=128, help="--engine: tokens per request")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def _rows(text: str, parser) -> list[int]:
    try:
        rows = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--rows: {text!r} is not a comma-separated list of integers")
    if not rows or min(rows) < 1:
        parser.error(f"--rows: {text!r}: each row count must be >= 1")
    return rows


def render(result: dict) -> str:
    """The table (plain aligned text) with the thread count and load in its title."""
    head = ["model", "linear", "rows", "N x K", "torch op µs", "direct µs", "saved µs", "direct / torch"]
    body = [[c["model"], c["linear"], str(c["rows"]), f"{c['out_features']} x {c['in_features']}",
             f"{c['torch_op_us']:.1f}", f"{c['direct_us']:.1f}", f"{c['saved_us']:.1f}",
             f"{c['ratio_direct_to_torch']:.3f}"] for c in result["cases"]]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    title = (f"CPU linear, float32, torch threads {result['torch_threads']}, oneDNN {result['onednn']}, "
             f"load {result['load_start'][0]:.2f} -> {result['load_end'][0]:.2f}")
    return "\n".join([title] + ["  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [head, *body]])


def main(argv: list[str] | None = None) -> int:
    from attnplug.runner.commands.bench.engine import hf_config
    from attnplug.runner.models import cpu_linear, onednn

    parser = _parser()
    args = parser.parse_args(argv)
    rows = _rows(args.rows, parser)
    if not cpu_linear.use_direct():
        print(f"attnplug bench linear: the direct oneDNN path is unavailable: {onednn.load_error()}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.engine:
        return _engine(args)
    load_start = list(os.getloadavg())
    cases = []
    for model in [m.strip() for m in args.model.split(",") if m.strip()]:
        for name, n, k in decode_shapes(hf_config(model)):
            for m in rows:
                cases.append({"model": model, "linear": name,
                              **time_case(n, k, m, args.rounds, args.iters, args.warmup)})
    result = {"torch_threads": torch.get_num_threads(), "onednn": ".".join(map(str, onednn.matmul_module().version())),
              "rounds": args.rounds, "iters": args.iters, "load_start": load_start,
              "load_end": list(os.getloadavg()), "cases": cases}
    print(json.dumps(result, indent=1) if args.json else render(result))
    bad = [c for c in cases if c["max_abs_diff"] != 0.0]
    for c in bad:
        print(f"attnplug bench linear: {c['model']} {c['linear']} rows {c['rows']}: outputs differ "
              f"(max |diff| {c['max_abs_diff']:.3g})", file=sys.stderr)
    return 1 if bad else 0


def _engine(args) -> int:
    from attnplug.runner.commands.bench import linear_engine

    workload = ["--num-requests", str(args.num_requests), "--output-len", str(args.output_len)]
    rows = [linear_engine.engine_ab(m.strip(), args.threads, args.rounds, workload)
            for m in args.model.split(",") if m.strip()]
    print(json.dumps({"rows": rows}, indent=1) if args.json else linear_engine.render(rows))
    bad = [r["model"] for r in rows if not linear_engine.same_outputs(r)]
    for m in bad:
        print(f"attnplug bench linear --engine: {m}: the two paths produced different outputs", file=sys.stderr)
    return 1 if bad else 0


__all__ = ["decode_shapes", "main", "render", "time_case"]
