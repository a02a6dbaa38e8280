"""``attnplug parity``: our engine against HF transformers on the same random weights
(``--hf-config``), or on the same real weights (``--model smollm2``, ``parity_real.py``).

Builds the HF model from a ``config.json`` with seeded random weights, loads the same
weights into our model, runs N requests of different prompt lengths through our engine
(continuous batching, chunked prefill under a small token budget, optionally forced
preemption) and through HF greedy decoding one request at a time (``attn_implementation
="eager"``, full recompute each step), then compares every generated token and the logits
that chose it. Under torchrun, ``--tensor-parallel-size`` / ``--pipeline-parallel-size``
shard our model over the ranks (``parity_parallel.py``; docs/distributed.md).

Tolerances on ``max |dlogit|`` (absolute, logits of the whole vocabulary), per dtype:
``float32`` 2e-3, ``bfloat16`` 0.5, ``float16`` 0.1. Tokens must be identical.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import torch

from attnplug.core.errors import AttnplugError
from attnplug.runner.commands.limits import OneLineParser, bounded_int
from attnplug.runner.commands import threads
from attnplug.runner.commands.parity_compare import (  # noqa: F401 (TOLERANCES, ParityResult: re-exported)
    DTYPES, PROMPT_LEN_RANGE, TOLERANCES, ParityResult, compare_with_reference, parity_max_model_len)


def _hf_model(cfg_dict: dict, seed: int, dtype: torch.dtype):
    try:
        import transformers
    except ImportError:
        raise AttnplugError("attnplug parity needs transformers: pip install 'attnplug[parity]'") from None
    from attnplug.runner.models import resolve_model_config

    resolve_model_config(cfg_dict)  # unsupported architecture -> error listing the supported ones
    cfg = transformers.AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(seed)
    # transformers >= 4.56 names the argument ``dtype`` (``torch_dtype`` is deprecated there).
    major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    kw = {"dtype": dtype} if major_minor >= (4, 56) else {"torch_dtype": dtype}
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", **kw)
    return cfg, hf.eval()


@torch.inference_mode()
def _hf_greedy(hf, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    ids = torch.tensor([prompt], dtype=torch.long)
    out, logits = [], []
    for _ in range(num_tokens):
        step = hf(input_ids=ids).logits[0, -1].float()
        tok = int(step.argmax())
        out.append(tok)
        logits.append(step)
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out, logits


def parity_models(cfg_dict: dict, seed: int, tdtype: torch.dtype, *, backend: str | None, block_size: int,
                  kv_cache_dtype: str = "auto"):
    """``(hf config, HF model, our model)`` on the same seeded random weights. Under tensor
    parallel (``runner.parallel.state.current()``) our model is this rank's and loads its
    shard of the HF weights (``sharding.shard_state_dict``)."""
    from attnplug.core.kv_quant import parse_kv_cache_dtype
    from attnplug.runner.commands.assemble import resolve_backend
    from attnplug.runner.commands.model_loading import build_with_backends
    from attnplug.runner.parallel.state import current

    cfg, hf = _hf_model(cfg_dict, seed, tdtype)
    model = build_with_backends(cfg, backend=backend, block_size=block_size, resolve=resolve_backend, dtype=tdtype,
                                kv_cache_dtype=parse_kv_cache_dtype(kv_cache_dtype))
    state_dict, state = hf.state_dict(), current()
    if state is not None and state.tp_size > 1:
        from attnplug.runner.parallel.sharding import shard_state_dict

        state_dict = shard_state_dict(state_dict, model.full_config, state.tp_size, state.tp_rank)
    model.load_hf_state_dict(state_dict)
    return cfg, hf, model


def run_parity(cfg_dict: dict, *, num_requests: int = 6, seed: int = 0, force_preemption: bool = False,
               dtype: str = "float32", max_num_batched_tokens: int = 24, max_tokens: int = 6,
               block_size: int = 4, backend: str | None = None,
               prompt_len_range: tuple[int, int] = PROMPT_LEN_RANGE, async_scheduling: bool = False,
               prefix_caching: bool = False, system_prompt_len: int = 24,
               speculative: str | None = None, kv_cache_dtype: str = "auto",
               kv_scales: str = "first_batch") -> ParityResult:
    """Run the comparison (see the module docstring).

    Raises:
        AttnplugError: unsupported architecture (lists the supported ones), missing
            transformers, bad options.
    """
    if dtype not in DTYPES:
        raise AttnplugError(f"dtype {dtype!r} not supported; choose one of {sorted(DTYPES)}")
    tdtype = DTYPES[dtype]
    if cfg_dict.get("model_type") == "qwen2_vl":  # images: runner/commands/parity_mm.py
        from attnplug.runner.commands.parity_mm import run_mm_parity
        from attnplug.runner.models import resolve_model_config

        resolve_model_config(cfg_dict)  # a bad config: ModelConfigError (an AttnplugError), one line
        return run_mm_parity(cfg_dict, num_requests=num_requests, seed=seed, force_preemption=force_preemption,
                             tdtype=tdtype, max_num_batched_tokens=max_num_batched_tokens, max_tokens=max_tokens,
                             block_size=block_size, backend=backend, async_scheduling=async_scheduling,
                             prefix_caching=prefix_caching, speculative=speculative, kv_cache_dtype=kv_cache_dtype)
    cfg, hf, model = parity_models(cfg_dict, seed, tdtype, backend=backend, block_size=block_size,
                                   kv_cache_dtype=kv_cache_dtype)

    rng = np.random.default_rng(seed)
    lo, hi = prompt_len_range
    lengths = rng.integers(lo, hi + 1, size=num_requests)
    vocab = int(cfg.vocab_size)
    prompts = {f"req-{i}": rng.integers(0, vocab, size=int(n)).tolist() for i, n in enumerate(lengths)}
    if prefix_caching:  # prompts that share prefixes (runner/commands/shared_prefixes.py)
        from attnplug.runner.commands.shared_prefixes import make_shared_prefix_prompts

        shared = make_shared_prefix_prompts(lengths.tolist(), vocab, seed, num_system_prompts=2,
                                            system_prompt_len=system_prompt_len, continuation_prob=0.3)
        prompts = {f"req-{i}": p for i, p in enumerate(shared)}
    max_model_len = parity_max_model_len(prompt_len_range, max_tokens, block_size)
    return compare_with_reference(
        model, prompts, lambda p: _hf_greedy(hf, p, max_tokens), tdtype, backend=backend, block_size=block_size,
        seed=seed, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, max_tokens=max_tokens,
        force_preemption=force_preemption, async_scheduling=async_scheduling, prefix_caching=prefix_caching,
        speculative=speculative, kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)


REAL_DEFAULTS = {"num_requests": 8, "max_tokens": 8, "max_num_batched_tokens": 64, "block_size": 16}
"""``parity --model`` (real weights) defaults; the random-weight ones are in :func:`run_parity`'s
signature (6, 6, 24, 4)."""
RANDOM_DEFAULTS = {"num_requests": 6, "max_tokens": 6, "max_num_batched_tokens": 24, "block_size": 4}


def main(argv: list[str]) -> int:
    p = OneLineParser(prog="attnplug parity", description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--hf-config", help="path to an HF config.json (or its directory): seeded random weights")
    which.add_argument("--model", help="real weights: smollm2 or PATH.gguf (runner/commands/parity_real.py): "
                                       "the bundled prompts, HF generate on the same dequantised weights")
    p.add_argument("--num-requests", type=bounded_int(1, 4096), default=None,
                   help="prompts to generate from, 8 with --model (default: 6)")
    p.add_argument("--seed", type=bounded_int(0, 2**32 - 1), default=0, help="seed of the random weights and prompts")
    p.add_argument("--force-preemption", action="store_true", help="force a preemption every 3 steps")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model and KV dtype")
    p.add_argument("--max-num-batched-tokens", type=bounded_int(1, 1048576), default=None,
                   help="token budget per step, 64 with --model (default: 24)")
    p.add_argument("--max-tokens", type=bounded_int(1, 1048576), default=None,
                   help="greedy tokens generated per request, 8 with --model (or until EOS) (default: 6)")
    p.add_argument("--block-size", type=bounded_int(1, 65536), default=None,
                   help="KV block size in tokens, 16 with --model (default: 4)")
    p.add_argument("--backend", default=None, help="as `attnplug run --backend` (default: selection)")
    p.add_argument("--async-scheduling", action="store_true", help="run the engine with one step in flight")
    p.add_argument("--prefix-caching", action="store_true",
                   help="prompts sharing prefixes (system prompts, continuations) and prefix caching on")
    p.add_argument("--speculative", default=None, metavar="METHOD:k=N",
                   help="speculative decoding as `attnplug run --speculative` (e.g. ngram:k=3)")
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON object (every ParityResult field) instead of the line")
    threads.add_flag(p)
    from attnplug.runner.commands import kv_cache_setup, run_parallel

    run_parallel.add_flags(p)  # under torchrun: our model sharded over the ranks (parity_parallel.py)

    kv_cache_setup.add_flags(p, memory=False)  # fp8: agreement with HF's fp32 cache is measured, not required
    args = p.parse_args(argv)
    if (why := kv_cache_setup.flag_problem(args)) is not None:
        print(f"attnplug parity: {why}", file=sys.stderr)
        return 2
    if (status := threads.apply(args.torch_threads, "attnplug parity")) is not None:
        return status
    for key, value in (REAL_DEFAULTS if args.model else RANDOM_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    from attnplug.runner.commands.model_loading import read_hf_config

    common = dict(num_requests=args.num_requests, seed=args.seed, force_preemption=args.force_preemption,
                  dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, max_tokens=args.max_tokens,
                  block_size=args.block_size, backend=args.backend, async_scheduling=args.async_scheduling,
                  prefix_caching=args.prefix_caching, speculative=args.speculative,
                  kv_cache_dtype=args.kv_cache_dtype, kv_scales=args.kv_scales)
    if run_parallel.wanted(args):
        if args.model:
            print("attnplug parity: real weights (--model) run in one process: drop --tensor-parallel-size / "
                  "--pipeline-parallel-size", file=sys.stderr)
            return 2
        from attnplug.runner.commands import parity_parallel

        try:
            cfg_dict = read_hf_config(args.hf_config)
        except AttnplugError as e:
            print(f"attnplug parity: {e}", file=sys.stderr)
            return 2
        return parity_parallel.run(args, cfg_dict, common, run_parity=run_parity, parity_models=parity_models)
    try:
        if args.model:
            from attnplug.runner.commands.parity_real import run_real_parity

            res = run_real_parity(args.model, **common)
        else:
            res = run_parity(read_hf_config(args.hf_config), **common)
    except AttnplugError as e:
        print(f"attnplug parity: {e}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(res), indent=1) if args.json else res.line())
    return 0 if res.ok else 1
