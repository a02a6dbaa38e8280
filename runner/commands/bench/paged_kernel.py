"""``attnplug bench paged-kernel``: one paged-attention call, ``cpu_sdpa``'s kernel against vLLM's CPU op.

The two run side by side on the same data: attnplug's compiled paged kernel
(``backends/cpu_sdpa/paged.py``) in this process, vLLM's ``cpu_attention_with_kv_cache`` (its
CPU build, ``--vllm-python``) in a subprocess (``bench/paged_kernel_vllm.py``: vLLM keeps
process-wide state and lives in its own environment). A case is a decode batch — ``B``
requests, one query token each after its cached context — of one attention shape:

* ``--shape``: ``tiny-llama`` (8 query / 2 KV heads of 32) and ``smollm2`` (9 / 3 of 64),
  or ``H:H_kv:D``;
* ``--batch`` (requests) and ``--context`` (cached tokens: ``N``, every request alike, or
  ``LO-HI``, spread evenly over the batch);
* ``--threads``: OpenMP / torch threads, both sides alike.

Every case is written once (float32, random, the block table a random permutation of the
cache's blocks; block size ``--block-size``, 32 by default as ``bench engine``, where vLLM
picks its ``vec`` ISA) and timed in ``--rounds`` rounds; a round times ``--iters`` calls of
each side after ``--warmup`` (median µs), the side that goes first alternating by round, so a
load spike on the shared machine hits both alike. Reported per case: the median over rounds
of each side's µs per call, ns per (query head x key) pair, the median of the rounds'
attnplug ÷ vLLM time ratios (< 1: attnplug faster), and the largest difference of the two
outputs (beyond ``TOLERANCE``: exit 1). ``--json PATH`` writes the rows, the torch thread
counts and the load averages. Without ``--vllm-python`` (or with ``none``) only attnplug's
side is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

from attnplug.runner.commands.bench.median_time import median_us
from attnplug.runner.commands.limits import OneLineParser, bounded_int

SHAPES = {"tiny-llama": (8, 2, 32), "smollm2": (9, 3, 64)}
"""``--shape`` presets: ``(query heads, KV heads, head size)`` of the bench-engine models."""

TOLERANCE = 1e-4
"""Largest absolute difference of the two float32 outputs accepted."""

VLLM_SIDE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paged_kernel_vllm.py")


@dataclass
class Row:
    """One case's figures (``None`` where a side was not timed)."""

    shape: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    batch: int
    context: str
    threads: int
    attnplug_us: float
    vllm_us: float | None = None
    ratio: float | None = None  # attnplug ÷ vLLM time, median of the rounds' ratios
    attnplug_ns_per_pair: float = 0.0
    vllm_ns_per_pair: float | None = None
    max_abs_diff: float | None = None
    vllm_isa: str | None = None


def contexts(text: str, batch: int) -> list[int]:
    """The cached tokens of each of ``batch`` requests: ``N`` for all, ``LO-HI`` spread evenly."""
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    return [lo_i + (hi_i - lo_i) * i // max(batch - 1, 1) for i in range(batch)]


def make_case(heads: tuple[int, int, int], ctxs: list[int], block_size: int, seed: int) -> dict:
    """A decode batch: ``query`` ``[B, H, D]``, ``kv_cache`` ``[num_blocks, 2, block_size,
    H_kv, D]`` (random; one spare block), ``block_table`` ``[B, max_blocks]`` (a random
    permutation of the blocks), ``query_start_loc`` ``[B + 1]``, ``seq_lens`` ``[B]`` (the
    context + the query token), int32; ``scale`` ``D ** -0.5``."""
    h, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    seq = [c + 1 for c in ctxs]
    per = [(s + block_size - 1) // block_size for s in seq]
    nb = sum(per) + 1
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    table = torch.zeros(len(seq), max(per), dtype=torch.int32)
    at = 0
    for r, n in enumerate(per):
        table[r, :n] = perm[at:at + n]
        at += n
    return {"query": torch.randn(len(seq), h, d, generator=g),
            "kv_cache": torch.randn(nb, 2, block_size, hkv, d, generator=g),
            "block_table": table, "query_start_loc": torch.arange(len(seq) + 1, dtype=torch.int32),
            "seq_lens": torch.tensor(seq, dtype=torch.int32), "scale": d ** -0.5}


class VllmSide:
    """``paged_kernel_vllm.py`` in a subprocess of ``python``: one ``time`` line per call."""

    def __init__(self, python: str, max_threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(max_threads)}
        self.proc = subprocess.Popen([python, VLLM_SIDE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)

    def time(self, path: str, threads: int, iters: int, warmup: int) -> dict:
        self.proc.stdin.write(f"time {path} {threads} {iters} {warmup}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("TIME "):
                return json.loads(line[5:])
        raise RuntimeError(f"the vLLM subprocess ended (exit status {self.proc.wait()}): see its stderr")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


def _attnplug_call(case: dict, threads: int):
    from attnplug.backends.cpu_sdpa import paged

    out = torch.zeros_like(case["query"])
    reqs = torch.arange(case["seq_lens"].shape[0], dtype=torch.int64)
    args = (out, case["query"], case["kv_cache"], case["block_table"], case["query_start_loc"], case["seq_lens"],
            reqs)
    return (lambda: paged.paged_attention(*args, scale=case["scale"], num_threads=threads)), out


def run_case(args, vllm: VllmSide | None, workdir: str, shape: str, batch: int, ctx: str, threads: int) -> Row:
    """One case, ``args.rounds`` rounds, the sides alternating which goes first."""
    heads = SHAPES.get(shape) or tuple(int(x) for x in shape.split(":"))
    ctxs = contexts(ctx, batch)
    case = make_case(heads, ctxs, args.block_size, args.seed)
    path = os.path.join(workdir, f"case-{shape.replace(':', '_')}-{batch}-{ctx}.pt")
    torch.save(case, path)
    call, out = _attnplug_call(case, threads)
    ours, theirs, ratios, info = [], [], [], {}
    for r in range(args.rounds):
        if vllm is not None and r % 2:
            info = vllm.time(path, threads, args.iters, args.warmup)
            theirs.append(info["us"])
        ours.append(median_us(call, args.iters, args.warmup))
        if vllm is not None and not r % 2:
            info = vllm.time(path, threads, args.iters, args.warmup)
            theirs.append(info["us"])
        if theirs:
            ratios.append(ours[-1] / theirs[-1])
    pairs = heads[0] * sum(c + 1 for c in ctxs)
    row = Row(shape, heads[0], heads[1], heads[2], batch, ctx, threads, statistics.median(ours),
              attnplug_ns_per_pair=1e3 * statistics.median(ours) / pairs)
    if theirs:
        row.vllm_us, row.ratio = statistics.median(theirs), statistics.median(ratios)
        row.vllm_ns_per_pair, row.vllm_isa = 1e3 * row.vllm_us / pairs, info.get("isa")
        row.max_abs_diff = float((out - torch.load(path + ".vllm-out.pt")).abs().max())
    return row


def render(rows: list[Row], report: dict) -> str:
    """The markdown table, headed by the thread counts and the load."""
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    head = ("| shape | H:H_kv × D | B | context | threads | attnplug µs | vLLM µs | attnplug ns/pair | "
            "vLLM ns/pair | attnplug ÷ vLLM time | max abs diff | vLLM ISA |")
    lines = [f"torch {torch.__version__}, float32, block {report['args']['block_size']}; {report['args']['rounds']} "
             f"rounds of {report['args']['iters']} calls per side, alternating; load average at start / end: "
             f"{report['load_start'][0]:.2f} / {report['load_end'][0]:.2f}", "", head, "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r.shape} | {r.num_heads}:{r.num_kv_heads} × {r.head_size} | {r.batch} | {r.context} | "
                     f"{r.threads} | {r.attnplug_us:,.0f} | {f(r.vllm_us, ',.0f')} | {r.attnplug_ns_per_pair:.2f} | "
                     f"{f(r.vllm_ns_per_pair, '.2f')} | {f(r.ratio, '.2f')} | {f(r.max_abs_diff, '.1e')} | "
                     f"{r.vllm_isa or '-'} |")
    return "\n".join(lines)


def _list(kind):
    """A comma list of ``kind`` values (argparse ``type=``; a bad item: its message)."""
    def parse(text: str) -> list:
        try:
            items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if not items:
            raise argparse.ArgumentTypeError(f"empty list {text!r}")
        return items
    return parse


def _shape(text: str) -> str:
    if text in SHAPES:
        return text
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[0]) % int(parts[1]):
        raise ValueError(f"{text!r}: expected {' / '.join(SHAPES)} or H:H_kv:D with H a multiple of H_kv")
    return text


def _context(text: str) -> str:
    lo, _, hi = text.partition("-")
    if not lo.isdigit() or (hi and (not hi.isdigit() or int(hi) < int(lo))) or int(lo) < 1:
        raise ValueError(f"{text!r}: expected N or LO-HI cached tokens (LO >= 1)")
    return text


def parser() -> OneLineParser:
    p = OneLineParser(prog="attnplug bench paged-kernel", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=_list(_shape), default=["tiny-llama", "smollm2"],
                   help="comma list of tiny-llama, smollm2 or H:H_kv:D")
    p.add_argument("--batch", type=_list(bounded_int(1, 4096)), default=[16, 64], help="requests per call")
    p.add_argument("--context", type=_list(_context), default=["320", "100-600"],
                   help="cached tokens per request: N or LO-HI (spread over the batch)")
    p.add_argument("--threads", type=_list(bounded_int(1, 256)), default=[1, 2], help="threads, both sides")
    p.add_argument("--block-size", type=bounded_int(1, 1024), default=32)
    p.add_argument("--rounds", type=bounded_int(1, 1000), default=4)
    p.add_argument("--iters", type=bounded_int(1, 100_000), default=30)
    p.add_argument("--warmup", type=bounded_int(0, 100_000), default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default="none",
                   help="the Python of an environment with vLLM's CPU build ('none': attnplug's side only)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the rows, threads and load as JSON")
    return p


def main(argv: list[str]) -> int:
    """``attnplug bench paged-kernel [--shape ...] [--vllm-python PY] [--json PATH]``; exit 1
    when the outputs differ beyond ``TOLERANCE``, 2 on a bad flag."""
    from attnplug.backends.cpu_sdpa import paged

    p = parser()
    args = p.parse_args(argv)
    if not paged.available():
        print("attnplug bench paged-kernel: the compiled kernel (backends/cpu_sdpa/_paged) is not built",
              file=sys.stderr)
        return 2
    if args.vllm_python != "none" and not os.path.exists(args.vllm_python):
        p.error(f"--vllm-python {args.vllm_python!r} does not exist")
    before, load_start, rows = torch.get_num_threads(), list(os.getloadavg()), []
    vllm = VllmSide(args.vllm_python, max(args.threads)) if args.vllm_python != "none" else None
    try:
        with tempfile.TemporaryDirectory(prefix="attnplug-paged-kernel-") as workdir:
            for shape in args.shape:
                for batch in args.batch:
                    for ctx in args.context:
                        for n in args.threads:
                            torch.set_num_threads(n)
                            rows.append(run_case(args, vllm, workdir, shape, batch, ctx, n))
    finally:
        torch.set_num_threads(before)
        if vllm is not None:
            vllm.close()
    report = {"torch_threads": args.threads, "torch": torch.__version__, "load_start": load_start,
              "load_end": list(os.getloadavg()), "args": vars(args), "rows": [asdict(r) for r in rows]}
    print(render(rows, report), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
    bad = [r for r in rows if r.max_abs_diff is not None and not r.max_abs_diff <= TOLERANCE]
    if bad:
        print(f"attnplug bench paged-kernel: outputs differ beyond {TOLERANCE} in {len(bad)} case(s)", file=sys.stderr)
        return 1
    return 0


__all__ = ["SHAPES", "TOLERANCE", "Row", "contexts", "main", "make_case", "parser", "render", "run_case"]
