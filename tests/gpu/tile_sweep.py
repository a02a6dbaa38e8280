"""Tile-size sweep of the triton backend's paged attention on a CUDA GPU (a developer's tool).

    python tests/gpu/tile_sweep.py [--json PATH] [--iters 20] [--head-size 128] [--dtype bf16]

Times ``backends/triton/attention.paged_attention`` with each :class:`TileConfig` of a
list against the one :func:`choose_tiles` picks, on the layer of ``attnplug bench
attention`` (32 heads / 8 KV heads x ``--head-size``, ``--dtype``, block 16) and two batches: a prefill
(4 fresh prompts of 2,048 tokens) and a mixed step (128 one-token decodes over 1,024-3,071
keys and 4 prefill chunks of 512 tokens over 0-1,536 computed ones). Each variant's output
is compared with ``torch_native``-style dense attention in float32 (max |diff| must stay
under 3e-2, else the row says ``WRONG`` and the exit status is 1; a configuration Triton
cannot compile for the device, e.g. out of shared memory, is listed as such); times are medians of
``--iters`` calls with a cold L2 (``runner/commands/bench/timing.time_gpu``). Prints a
markdown table with the torch version and thread count; ``--json`` writes the rows (after
each one).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from attnplug.backends.triton.attention import TileConfig, choose_tiles, compute_capability, paged_attention
from attnplug.runner.commands.bench.timing import time_gpu

HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
VARIANTS = [  # (block_m, tile_n, num_warps, num_stages); block_q = block_m // 4
    (64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 2),
]


def _batch(requests: list[tuple[int, int]], dtype, device, gen, head: int = HEAD):
    """Query, a paged cache holding every request's keys, and the metadata tensors."""
    seq = [c + s for c, s in requests]
    blocks = [-(-n // BLOCK) for n in seq]
    num_blocks = sum(blocks) + 1
    cache = torch.randn(num_blocks, 2, BLOCK, KV_HEADS, head, generator=gen, dtype=torch.float32).to(device, dtype)
    table = torch.zeros(len(requests), max(blocks), dtype=torch.int32)
    start = 1
    for i, b in enumerate(blocks):
        table[i, :b] = torch.arange(start, start + b)
        start += b
    q_lens = [s for _, s in requests]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    query = torch.randn(sum(q_lens), HEADS, head, generator=gen).to(device, dtype)
    return query, cache, table.to(device), qsl.to(device), torch.tensor(seq, dtype=torch.int32, device=device)


def _reference(query, cache, table, requests) -> torch.Tensor:
    """Dense causal (bottom-right) attention in float32, per request."""
    head = query.shape[-1]
    out, tok = torch.empty(query.shape, dtype=torch.float32, device=query.device), 0
    for i, (c, s) in enumerate(requests):
        n = c + s
        ids = table[i, : -(-n // BLOCK)].long()
        k = cache[ids, 0].reshape(-1, KV_HEADS, head)[:n].float().repeat_interleave(HEADS // KV_HEADS, 1)
        v = cache[ids, 1].reshape(-1, KV_HEADS, head)[:n].float().repeat_interleave(HEADS // KV_HEADS, 1)
        q = query[tok: tok + s].float()
        logits = torch.einsum("qhd,khd->hqk", q, k) * head ** -0.5
        pos = torch.arange(c, n, device=q.device)[:, None]
        logits = logits.masked_fill(torch.arange(n, device=q.device)[None, :] > pos, float("-inf"))
        out[tok: tok + s] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v)
        tok += s
    return out


def sweep(iters: int, json_path: str | None = None, head: int = HEAD,
          dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """The rows (see the module docstring); ``json_path`` is rewritten after each row, so a
    run stopped by a timeout keeps what it measured."""
    device, gen, group = torch.device("cuda"), torch.Generator().manual_seed(0), HEADS // KV_HEADS
    workloads = {
        "prefill 4 x 2048": [(0, 2048)] * 4,
        "mixed 128d+4p/512": [(1024 + 16 * i, 1) for i in range(128)] + [(512 * i, 512) for i in range(4)],
    }
    rows = []
    for name, requests in workloads.items():
        query, cache, table, qsl, seq = _batch(requests, dtype, device, gen, head)
        want = _reference(query, cache, table, requests)
        max_q = max(s for _, s in requests)
        default = choose_tiles(max_q, group, head, dtype, interpreter=False, sm=compute_capability(device))
        configs = [default] + [TileConfig(m, m // group, n, w, st) for m, n, w, st in VARIANTS
                               if (m, n, w, st) != (default.block_m, default.tile_n, default.num_warps,
                                                    default.num_stages)]
        for cfg in configs:
            out = torch.zeros_like(query)

            def call(cfg=cfg, out=out):
                paged_attention(query, cache[:, 0], cache[:, 1], out, qsl, seq, table, num_reqs=len(requests),
                                max_query_len=max_q, scale=head ** -0.5, tiles=cfg, check_values=False)
            row = dict(workload=name, block_m=cfg.block_m, block_q=cfg.block_q, tile_n=cfg.tile_n,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, chosen=cfg == default)
            try:
                call()
                torch.cuda.synchronize()
            except Exception as exc:  # e.g. triton's OutOfResources: the configuration does not fit
                rows.append({**row, "ms": None, "max_abs_diff": None, "ok": cfg != default,
                             "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                print(f"{name}: {cfg} did not run: {rows[-1]['error']}", file=sys.stderr, flush=True)
                continue
            diff = float((out.float() - want).abs().max())
            timing = time_gpu(call, iters=iters, warmup=2)
            rows.append({**row, "ms": timing.median_ms, "max_abs_diff": diff, "ok": diff < 3e-2})
            print(f"{name}: {cfg} {timing.median_ms:.3f} ms diff {diff:.2e}", file=sys.stderr, flush=True)
            if json_path:
                _write_json(json_path, rows)
    return rows


def _write_json(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"torch": torch.__version__, "torch_threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--head-size", type=int, default=HEAD)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)
    rows = sweep(args.iters, args.json, args.head_size, DTYPES[args.dtype])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, torch threads {torch.get_num_threads()}; "
          f"{args.dtype}, {HEADS}/{KV_HEADS} heads x {args.head_size}, block {BLOCK}; median of {args.iters} calls, "
          f"cold L2\n")
    print("| workload | block_m x tile_n | warps | stages | ms | vs chosen | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(x["ms"] for x in rows if x["workload"] == r["workload"] and x["chosen"])
        mark = " (chosen)" if r["chosen"] else ""
        head = f"| {r['workload']} | {r['block_m']} x {r['tile_n']}{mark} | {r['num_warps']} | {r['num_stages']} | "
        if r["ms"] is None:
            print(head + f"- | - | did not run: {r['error'][:60]} |")
            continue
        vs = f"{base / r['ms']:.2f}" if base else "-"
        print(head + f"{r['ms']:.3f} | {vs} | {r['max_abs_diff']:.1e}{'' if r['ok'] else ' WRONG'} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
