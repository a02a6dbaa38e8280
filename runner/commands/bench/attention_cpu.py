"""``attnplug bench attention`` on the CPU: µs per ``forward`` and achieved GB/s over a sweep.

What runs when the machine has no CUDA device (or with ``--device cpu``). The sweep is
synthetic, not the trace (a kernel author wants the axes): every combination of

* workload: ``decode`` (``B`` requests, one new token each after ``context`` cached
  tokens, all the same length), ``decode-mixed`` (the same, contexts spread evenly over
  ``context/2 .. context``: the ragged case) and ``prefill`` (``B`` whole prompts of
  ``context`` tokens);
* ``--batch`` (decodes) / ``--prefill-batch`` (prompts), ``--context``, ``--heads``
  (``H:H_kv`` pairs) and ``--head-size``;

for every backend named by ``--backend`` (default: ``torch_native`` and every registered
attention backend that declares the CPU without an interpreter; ``triton`` on the CPU only
runs in its interpreter, which times Python; ``cpu_sdpa-gather``, ``cpu_sdpa`` with its compiled
paged kernel off — the SDPA path on gathered blocks — when that kernel is built). Each backend's ``forward`` runs through the
attnplug contract exactly as on the GPU (``attention_inputs.backend_inputs``: its own
builder, built once and not timed; its own cache layout; the K/V write included).

Reported per row: µs per call (median of ``--iters`` wall-clock calls after ``--warmup``;
the backends of a row run in rotation, one call each per round, so load on a shared
machine hits them alike),
GB/s (the least traffic any kernel needs, ``attention._metrics``: cached K/V read once, the
step's K/V read and written, queries read, outputs written), the speed-up over
``torch_native`` on the same row ("vs native", > 1 is faster), ``max |Δ|`` against
``torch_native`` (beyond ``attention.TOLERANCE``: ``error: wrong result``, exit 1), and the
torch intra-op thread count the run used (``torch.get_num_threads()``, also in the JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from attnplug.runner.commands.bench.attention_inputs import Batch, backend_inputs, dense_kv
from attnplug.runner.commands.limits import OneLineParser, bounded_int


@dataclass
class CpuResult:
    """One (workload, backend) row of the CPU sweep (``None`` where not measured)."""

    workload: str
    backend: str
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    us: float | None = None
    gbps: float | None = None
    vs_native: float | None = None
    max_abs_diff: float | None = None
    note: str = ""


def sweep_batches(args) -> list[tuple[Batch, int, int]]:
    """``(batch, B, context)`` for every workload x batch size x context of the sweep."""
    out = []
    for context in args.context:
        if "decode" in args.workload:
            out += [(Batch(f"decode B={b} ctx={context}", [(context, 1)] * b), b, context) for b in args.batch]
        if "decode-mixed" in args.workload:
            for b in args.batch:
                ctxs = [context // 2 + (context - context // 2) * i // max(b - 1, 1) for i in range(b)]
                out.append((Batch(f"decode-mixed B={b} ctx<={context}", [(c, 1) for c in ctxs]), b, context))
        if "prefill" in args.workload:
            out += [(Batch(f"prefill B={b} len={context}", [(0, context)] * b), b, context)
                    for b in args.prefill_batch]
    return out


def time_interleaved(calls: list, iters: int, warmup: int) -> list[float]:
    """Median wall-clock microseconds of each of ``calls``, run in rotation (one call of
    each per round, ``warmup`` rounds untimed, then ``iters`` rounds): a load spike on a
    shared machine hits every backend of the row alike, so their ratio holds."""
    for _ in range(warmup):
        for fn in calls:
            fn()
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(iters):
        for fn, times in zip(calls, samples):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return [statistics.median(times) for times in samples]


VARIANTS = {"cpu_sdpa-gather": "CpuSdpaGatherBackend"}
"""Backends the sweep times besides the registry's (``backends/cpu_sdpa/backend.py``'s classes):
``cpu_sdpa`` with its compiled kernel off, the path a build without the kernel runs."""


def _get_backend(reg, name: str):
    if name in VARIANTS:
        from attnplug.backends.cpu_sdpa import backend

        return getattr(backend, VARIANTS[name])
    return reg.get(name)


def _default_backends() -> list[str]:
    from attnplug.backends.cpu_sdpa import paged
    from attnplug.plugins.discovery import get_registry

    reg = get_registry()
    names = [n for n in reg.names() if reg.get(n).kv_cache_kind == "attention" and n != "triton"
             and "cpu" in reg.get(n).supported_devices]
    names = ["torch_native"] + [n for n in names if n != "torch_native"]
    return names + (["cpu_sdpa-gather"] if paged.available() and "cpu_sdpa" in names else [])


def _prepare(batch: Batch, b: int, context: int, name: str, backend, args, dtype, kv_dense):
    """One backend on one batch: its row, its ``forward`` call and the output it writes
    (call and output ``None`` when the backend rejects the layer)."""
    from attnplug.core.contracts import AttentionLayerConfig

    res = CpuResult(batch.name.split()[0], name, b, context, args.num_heads, args.num_kv_heads, args.head_size)
    layer = AttentionLayerConfig(args.num_heads, args.num_kv_heads, args.head_size, dtype=dtype,
                                 block_size=args.block_size, device="cpu")
    reasons = backend.validate_configuration(layer)
    if reasons:
        res.note = "skipped: " + "; ".join(reasons)
        return res, None, None
    impl, md, kv, q, k, v, _ = backend_inputs(batch, backend, args, dtype, kv_dense)
    out = torch.zeros_like(q)
    return res, (lambda: impl.forward(None, q, k, v, kv, md, out)), out


def _time_batch(batch: Batch, b: int, context: int, args, dtype, reg) -> list[CpuResult]:
    """Every backend on ``batch``, timed in rotation; rates, ratios and the check against
    ``torch_native`` filled in."""
    from attnplug.runner.commands.bench.attention import _check_against_reference, _metrics

    kv_dense = dense_kv(batch, args, dtype)
    rows = [_prepare(batch, b, context, n, _get_backend(reg, n), args, dtype, kv_dense) for n in args.backend]
    live = [(res, call) for res, call, _ in rows if call is not None]
    for (res, _), us in zip(live, time_interleaved([call for _, call in live], args.iters, args.warmup)):
        res.us = us
        res.gbps = _metrics(batch, us / 1e3, args, torch.empty((), dtype=dtype).element_size())[1]
    native = next(((res, out) for res, _, out in rows if res.backend == "torch_native" and res.us), None)
    for res, _, out in rows:
        if native is not None and res.us:
            _check_against_reference(res, out, native[1].float(), dtype)
            res.vs_native = native[0].us / res.us
    return [res for res, _, _ in rows]


def run(args) -> list[CpuResult]:
    """Time every backend on every batch of the sweep; rows in sweep order, ``torch_native``'s
    output the reference of its batch."""
    from attnplug.plugins.discovery import get_registry
    from attnplug.runner.commands.bench.attention import DTYPES

    dtype, reg, results = DTYPES[args.dtype], get_registry(), []
    for heads in args.heads:
        for head_size in args.head_size:
            shape_args = argparse.Namespace(**{**vars(args), "head_size": head_size, "num_heads": heads[0],
                                               "num_kv_heads": heads[1]})
            for batch, b, context in sweep_batches(shape_args):
                results += _time_batch(batch, b, context, shape_args, dtype, reg)
    return results


COLUMNS = ("workload", "B", "context", "heads", "head size", "backend", "µs/call", "GB/s", "vs native",
           "max abs diff", "note")


def render(results: list[CpuResult], args) -> str:
    """The markdown table, headed by the thread count and the timing method."""
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [f"CPU, torch {torch.__version__}, torch threads {torch.get_num_threads()}, {args.dtype}, "
             f"block {args.block_size}; µs: median wall-clock of {args.iters} `forward` calls (K/V write included, "
             "metadata build excluded); vs native: torch_native's µs / this row's.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        cells = (r.workload, str(r.batch), str(r.context), f"{r.num_heads}:{r.num_kv_heads}", str(r.head_size),
                 r.backend, f(r.us, ",.0f"), f(r.gbps, ".2f"), f(r.vs_native, ".2f"), f(r.max_abs_diff, ".1e"),
                 r.note)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


WORKLOADS = ("decode", "decode-mixed", "prefill")


def _positive_ints(text: str) -> list[int]:
    """A comma list of integers in ``[1, 1_000_000]``."""
    parse = bounded_int(1, 1_000_000)
    values = [parse(x) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def _workloads(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(WORKLOADS)}, got {text!r}")
    return names


def _heads(text: str) -> list[tuple[int, int]]:
    """``H:H_kv`` pairs (``H`` alone means ``H:H``); ``H`` a multiple of ``H_kv``."""
    pairs = []
    for item in text.split(","):
        h, _, kv = item.strip().partition(":")
        num_heads, num_kv_heads = _positive_ints(h)[0], _positive_ints(kv or h)[0]
        if num_heads % num_kv_heads:
            raise argparse.ArgumentTypeError(f"{item.strip()!r}: query heads must be a multiple of KV heads")
        pairs.append((num_heads, num_kv_heads))
    return pairs


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="attnplug bench attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu"], default="cpu")
    p.add_argument("--backend", action="append", default=None, metavar="NAME",
                   help="backend to time (repeatable, or a comma list; default: torch_native and every CPU backend)")
    p.add_argument("--workload", type=_workloads, default=list(WORKLOADS),
                   help="comma list of decode, decode-mixed, prefill")
    p.add_argument("--batch", type=_positive_ints, default=[1, 16, 64], help="decode batch sizes (default 1,16,64)")
    p.add_argument("--prefill-batch", type=_positive_ints, default=[1, 4], help="prompts per prefill batch (default 1,4)")
    p.add_argument("--context", type=_positive_ints, default=[128, 1024], help="context / prompt lengths (default 128,1024)")
    p.add_argument("--heads", type=_heads, default=[(9, 3), (32, 8)],
                   help="H:H_kv pairs (default 9:3,32:8: SmolLM2-135M's and a Llama-8B layer's)")
    p.add_argument("--head-size", type=_positive_ints, default=[64], help="head sizes (default 64)")
    p.add_argument("--block-size", type=bounded_int(1, 4096), default=16)
    p.add_argument("--max-model-len", type=bounded_int(2, 1_048_576), default=None, help="default: the longest context + 1")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--iters", type=bounded_int(1, 100_000), default=20)
    p.add_argument("--warmup", type=bounded_int(0, 100_000), default=3)
    p.add_argument("--json", metavar="PATH", default=None, help="also write the rows and the thread count as JSON")
    return p


def main(argv: list[str]) -> int:
    """``attnplug bench attention [--device cpu] ...`` on the CPU; exit 1 on a wrong result."""
    from attnplug.plugins.discovery import get_registry

    p = parser()
    args = p.parse_args(argv)
    args.backend = [n.strip() for item in args.backend for n in item.split(",") if n.strip()] \
        if args.backend else _default_backends()
    known = [*get_registry().names(), *VARIANTS]
    unknown = [n for n in args.backend if n not in known]
    if unknown:
        p.error(f"--backend: unknown backend {', '.join(map(repr, unknown))}; known backends: {', '.join(known)}")
    if args.max_model_len is not None and args.max_model_len <= max(args.context):
        p.error(f"--max-model-len {args.max_model_len} must exceed the longest --context ({max(args.context)})")
    args.max_model_len = args.max_model_len or max(args.context) + 1
    results = run(args)
    print(render(results, args), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"device": "cpu", "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                       "args": {k: v for k, v in vars(args).items()}, "results": [asdict(r) for r in results]},
                      fh, indent=1)
    return 0 if all(not r.note.startswith("error") for r in results) else 1


__all__ = ["VARIANTS", "CpuResult", "main", "parser", "render", "run", "sweep_batches", "time_interleaved"]
