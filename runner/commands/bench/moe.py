"""``attnplug bench moe``: the mixture-of-experts block, vectorised against a per-token loop.

One :class:`~attnplug.runner.models.moe.MoEBlock` with random weights (``N(0, 0.02)``,
seeded) runs a batch of 1, 16 and 256 tokens (``--tokens``) two ways in the same run:
the block's own ``forward`` (tokens sorted by expert, one matmul per expert that has
tokens) and :func:`~attnplug.runner.models.moe.naive_moe_forward` (a Python loop over tokens
and their k experts). Each figure is the median of ``--repeat`` timed calls after one
warm-up call; the two outputs are compared (``max |Δ|``) so that the speed-up is between
equal results. Reported: tokens/s of each, their ratio, and the experts the batch hit.

The block is a Qwen3-MoE-like default (``--hidden-size``, ``--num-experts``...), or the MoE
MLP of a config (``--hf-config``: ``qwen3_moe``, ``deepseek_v2``, ``deepseek_v3``, ``gpt_oss``).
A config whose MoE the block cannot run (an unknown family, a router or expert kind not
implemented, inconsistent expert counts) is one line naming the field, exit status 2.
The table (or ``--json``) records the torch thread count (``--torch-threads`` / ``ATTNPLUG_TORCH_THREADS``, default 1).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from attnplug.core.errors import AttnplugError
from attnplug.runner.commands.limits import OneLineParser, bounded_int
from attnplug.runner.commands import threads

TOLERANCE = 1e-4
"""Largest ``max |Δ|`` between the two paths (float32) that is not a wrong result."""


def _sizes(text: str) -> list[int]:
    import argparse

    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated token counts expected") from None
    if not sizes or any(not 1 <= n <= 65536 for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: token counts must be in [1, 65536]")
    return sizes


def moe_config_of(args):
    """The benchmarked :class:`MoEConfig`: from ``--hf-config``, else from the size flags.

    Raises:
        AttnplugError: an unreadable config, a family without a mixture of experts, or a
            ``ModelConfigError`` naming the field.
    """
    from attnplug.runner.models.moe_config import MOE_PARSERS, MoEConfig, parse_moe

    if args.hf_config is None:
        return MoEConfig(hidden_size=args.hidden_size, num_experts=args.num_experts,
                         num_experts_per_tok=args.num_experts_per_tok, moe_intermediate_size=args.moe_intermediate_size,
                         norm_topk_prob=True)
    from attnplug.runner.commands.model_loading import read_hf_config

    cfg = read_hf_config(args.hf_config)
    model_type = cfg.get("model_type")
    if model_type not in MOE_PARSERS:
        raise AttnplugError(f"model_type={model_type!r} has no mixture-of-experts MLP this benchmark runs "
                            f"(known: {', '.join(MOE_PARSERS)})")
    return parse_moe(cfg, model_type)


def _median_s(fn, x: torch.Tensor, repeat: int) -> float:
    fn(x)  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def run_moe_bench(moe, sizes: list[int], repeat: int, naive_repeat: int, seed: int = 0) -> list[dict]:
    """One row per token count: ``tokens``, ``vectorised_tokens_per_s``, ``naive_tokens_per_s``,
    ``speedup`` (vectorised / naive, same run), ``experts_hit``, ``max_abs_diff``."""
    from attnplug.runner.models.moe import MoEBlock, naive_moe_forward

    block = MoEBlock(moe, torch.float32, "cpu").eval()
    gen = torch.Generator().manual_seed(seed)
    block.init_weights(gen, 0.02)
    rows = []
    for n in sizes:
        x = torch.randn(n, moe.hidden_size, generator=gen)
        fast = _median_s(block, x, repeat)
        naive = _median_s(lambda t: naive_moe_forward(block, t), x, naive_repeat)
        diff = float((block(x) - naive_moe_forward(block, x)).abs().max())
        hit = int(block.get_router()(x)[1].unique().numel())
        rows.append({"tokens": n, "vectorised_tokens_per_s": n / fast, "naive_tokens_per_s": n / naive,
                     "speedup": naive / fast, "experts_hit": hit, "max_abs_diff": diff})
    return rows


def render(rows: list[dict], moe, threads: int) -> str:
    """The markdown table and its caption line."""
    lines = [f"MoE block: hidden {moe.hidden_size}, {moe.num_experts} experts, top-{moe.num_experts_per_tok}, "
             f"expert width {moe.moe_intermediate_size}, {moe.num_shared_experts} shared, router "
             f"{moe.scoring_func}/{moe.topk_method}, float32, CPU",
             "", "| tokens | experts hit | vectorised tok/s | per-token loop tok/s | speed-up | max abs diff |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['experts_hit']} | {r['vectorised_tokens_per_s']:,.0f} | "
                     f"{r['naive_tokens_per_s']:,.0f} | {r['speedup']:.1f}x | {r['max_abs_diff']:.1e} |")
    lines.append(f"\ntorch threads: {threads}; load average at start: "
                 + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``attnplug bench moe [--tokens 1,16,256] [--hf-config CONFIG.json] [--json] ...``"""
    p = OneLineParser(prog="attnplug bench moe", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=_sizes, default=[1, 16, 256], help="batch sizes in tokens (default 1,16,256)")
    p.add_argument("--hf-config", default=None, help="benchmark this config's MoE MLP (qwen3_moe, deepseek_v2/v3, gpt_oss)")
    p.add_argument("--hidden-size", type=bounded_int(1, 65536), default=512)
    p.add_argument("--num-experts", type=bounded_int(1, 4096), default=64)
    p.add_argument("--num-experts-per-tok", type=bounded_int(1, 4096), default=8)
    p.add_argument("--moe-intermediate-size", type=bounded_int(1, 65536), default=256)
    p.add_argument("--repeat", type=bounded_int(1, 10000), default=20, help="timed calls of the block (median)")
    p.add_argument("--naive-repeat", type=bounded_int(1, 10000), default=3, help="timed calls of the loop (median)")
    threads.add_flag(p, "1")
    p.add_argument("--threads", dest="torch_threads", default=None, metavar="N",
                   help="the same as --torch-threads")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of the table")
    args = p.parse_args(argv)
    try:
        moe = moe_config_of(args)
    except AttnplugError as e:
        print(f"attnplug bench moe: {e}", file=sys.stderr)
        return 2
    if (status := threads.apply(args.torch_threads, "attnplug bench moe", default=1)) is not None:
        return status
    rows = run_moe_bench(moe, args.tokens, args.repeat, args.naive_repeat)
    bad = [r["tokens"] for r in rows if not r["max_abs_diff"] <= TOLERANCE]
    if args.json:
        print(json.dumps({"torch_threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
                          "moe": {k: getattr(moe, k) for k in moe.__dataclass_fields__}, "rows": rows,
                          "wrong_results": bad}, indent=1))
    else:
        print(render(rows, moe, torch.get_num_threads()))
    if bad:
        print(f"attnplug bench moe: the two paths differ beyond {TOLERANCE:g} at {bad} tokens", file=sys.stderr)
        return 1
    return 0
