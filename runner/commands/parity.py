"""``attnplug parity``: our engine against HF transformers on the same random weights
(``--hf-config``), or on the same real weights (``--model smollm2``, ``parity_real.py``).

Builds the HF model from a ``config.json`` with seeded random weights, loads the same
weights into our model, runs N requests of different prompt lengths through our engine
(continuous batching, chunked prefill under a small token budget, optionally forced
preemption) and through HF greedy decoding one request at a time (``attn_implementation
="eager"``, full recompute each step), then compares every generated token and the logits
that chose it.

Tolerances on ``max |dlogit|`` (absolute, logits of the whole vocabulary), per dtype:
``float32`` 2e-3, ``bfloat16`` 0.5, ``float16`` 0.1. Tokens must be identical.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from attnplug.core.errors import AttnplugError
from attnplug.runner.commands.limits import OneLineParser, bounded_int

TOLERANCES = {torch.float32: 2e-3, torch.bfloat16: 0.5, torch.float16: 0.1}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ParityResult:
    """Outcome of a parity run."""

    ok: bool
    num_identical: int
    num_requests: int
    max_abs_dlogit: float
    tolerance: float
    first_divergence: dict[str, Any] | None = None
    preemptions: int = 0
    steps: int = 0
    details: list[str] = field(default_factory=list)
    prefix_cache_hits: int = 0
    """Tokens admitted as prefix-cache hits (``--prefix-caching``)."""
    prefix_cache_hit_requests: int = 0
    cascade_steps: int = 0
    spec: dict[str, Any] = field(default_factory=dict)
    """With ``--speculative``: drafts proposed / accepted (``SpecStats`` counters)."""

    def _spec_part(self) -> str:
        s = self.spec
        return f", {s['accepted']}/{s['proposed']} drafts accepted" if s else ""

    def line(self) -> str:
        if self.ok:
            return (f"parity: OK tokens {self.num_identical}/{self.num_requests} identical, "
                    f"max |dlogit| = {self.max_abs_dlogit:.3g} (tolerance {self.tolerance:g}; "
                    f"{self.steps} steps, {self.preemptions} preemptions"
                    + (f", {self.prefix_cache_hits} prefix-hit tokens in {self.prefix_cache_hit_requests} requests"
                       if self.prefix_cache_hit_requests else "") + f"{self._spec_part()})")
        d = self.first_divergence or {}
        where = ", ".join(f"{k}={v}" for k, v in d.items())
        return (f"parity: FAIL tokens {self.num_identical}/{self.num_requests} identical, "
                f"max |dlogit| = {self.max_abs_dlogit:.3g} (tolerance {self.tolerance:g}); first divergence: {where}")


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


def run_parity(cfg_dict: dict, *, num_requests: int = 6, seed: int = 0, force_preemption: bool = False,
               dtype: str = "float32", max_num_batched_tokens: int = 24, max_tokens: int = 6,
               block_size: int = 4, backend: str | None = None,
               prompt_len_range: tuple[int, int] = (3, 40), async_scheduling: bool = False,
               prefix_caching: bool = False, system_prompt_len: int = 24,
               speculative: str | None = None) -> ParityResult:
    """Run the comparison (see the module docstring).

    Raises:
        AttnplugError: unsupported architecture (lists the supported ones), missing
            transformers, bad options.
    """
    from attnplug.runner.commands.model_loading import build_with_backends
    from attnplug.runner.commands.assemble import resolve_backend

    if dtype not in DTYPES:
        raise AttnplugError(f"dtype {dtype!r} not supported; choose one of {sorted(DTYPES)}")
    tdtype = DTYPES[dtype]
    cfg, hf = _hf_model(cfg_dict, seed, tdtype)
    model = build_with_backends(cfg, backend=backend, block_size=block_size, resolve=resolve_backend, dtype=tdtype)
    model.load_hf_state_dict(hf.state_dict())

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
    max_model_len = int(hi + max_tokens + block_size)
    return compare_with_reference(
        model, prompts, lambda p: _hf_greedy(hf, p, max_tokens), tdtype, backend=backend, block_size=block_size,
        seed=seed, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, max_tokens=max_tokens,
        force_preemption=force_preemption, async_scheduling=async_scheduling, prefix_caching=prefix_caching,
        speculative=speculative)


def compare_with_reference(model, prompts: dict[str, list[int]], reference, tdtype: torch.dtype, *,
                           backend: str | None, block_size: int, seed: int, max_model_len: int,
                           max_num_batched_tokens: int, max_tokens: int, force_preemption: bool = False,
                           async_scheduling: bool = False, prefix_caching: bool = False,
                           speculative: str | None = None, stop_token_ids: tuple[int, ...] = ()) -> ParityResult:
    """Run ``prompts`` (request id -> token ids) through our engine on ``model`` (greedy,
    ``max_tokens`` each, the given scheduling options), then compare each request's tokens
    and logits with ``reference(prompt) -> (tokens, logits per token)``.

    With ``stop_token_ids`` a request may stop early: its tokens must then equal the
    reference's up to and including the stop token."""
    from attnplug.runner.commands.assemble import build_engine
    from attnplug.runner.step.scheduler_output import SamplingParams

    args = SimpleNamespace(
        model=None, backend=backend, block_size=block_size, seed=seed, max_model_len=max_model_len,
        max_num_seqs=len(prompts), max_num_batched_tokens=max_num_batched_tokens, num_blocks=None,
        force_preemption_every=3 if force_preemption else None, record_logits=True,
        async_scheduling=async_scheduling, prefix_caching=prefix_caching, speculative=speculative)
    setup = build_engine(args, model=model, requests=False)
    for rid, p in prompts.items():
        setup.engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                        stop_token_ids=stop_token_ids))
    results = setup.engine.run()

    tol = TOLERANCES[tdtype]
    max_d = 0.0
    identical = 0
    first = None
    for rid, prompt in prompts.items():
        ours = results[rid]
        ref_tokens, ref_logits = reference(prompt)
        cut = next((j + 1 for j, t in enumerate(ref_tokens) if t in stop_token_ids), len(ref_tokens))
        ref_tokens, ref_logits = ref_tokens[:cut], ref_logits[:cut]
        same = ours.output_token_ids == ref_tokens
        identical += same
        for j, (a, b) in enumerate(zip(ours.logits, ref_logits)):
            max_d = max(max_d, float((a.float() - b.float()).abs().max()))
        if not same and first is None:
            j = next((j for j, (a, b) in enumerate(zip(ours.output_token_ids, ref_tokens)) if a != b),
                     min(len(ours.output_token_ids), len(ref_tokens)))
            first = {"request": rid, "prompt_len": len(prompt), "output_step": j,
                     "ours": ours.output_token_ids[j] if j < len(ours.output_token_ids) else None,
                     "hf": ref_tokens[j] if j < len(ref_tokens) else None}
    ok = identical == len(prompts) and max_d <= tol
    if first is None and not ok:
        first = {"reason": f"max |dlogit| {max_d:.3g} above tolerance {tol:g}"}
    st = setup.engine.scheduler.spec
    spec = {"proposed": st.stats.num_draft_tokens, "accepted": st.stats.num_accepted_tokens} if st else {}
    res = ParityResult(ok, identical, len(prompts), max_d, tol, first,
                       preemptions=setup.engine.scheduler.num_preemptions, steps=setup.engine.stats.num_steps,
                       spec=spec)
    stats = getattr(setup.engine.scheduler.kv_cache_manager, "stats", None)
    if prefix_caching and stats is not None:
        res.prefix_cache_hits = stats.hits
        res.prefix_cache_hit_requests = stats.hit_requests
    res.cascade_steps = setup.engine.runner.num_cascade_steps if hasattr(setup.engine.runner, "num_cascade_steps") else 0
    return res


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
                   help="prompts to generate from (default 6; --model: 8)")
    p.add_argument("--seed", type=bounded_int(0, 2**32 - 1), default=0, help="seed of the random weights and prompts")
    p.add_argument("--force-preemption", action="store_true", help="force a preemption every 3 steps")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model and KV dtype")
    p.add_argument("--max-num-batched-tokens", type=bounded_int(1, 1048576), default=None,
                   help="token budget per step (default 24; --model: 64)")
    p.add_argument("--max-tokens", type=bounded_int(1, 1048576), default=None,
                   help="greedy tokens generated per request (default 6; --model: 8, or until EOS)")
    p.add_argument("--block-size", type=bounded_int(1, 65536), default=None,
                   help="KV block size in tokens (default 4; --model: 16)")
    p.add_argument("--backend", default=None, help="as `attnplug run --backend` (default: selection)")
    p.add_argument("--async-scheduling", action="store_true", help="run the engine with one step in flight")
    p.add_argument("--prefix-caching", action="store_true",
                   help="prompts sharing prefixes (system prompts, continuations) and prefix caching on")
    p.add_argument("--speculative", default=None, metavar="METHOD:k=N",
                   help="speculative decoding as `attnplug run --speculative` (e.g. ngram:k=3)")
    args = p.parse_args(argv)
    for key, value in (REAL_DEFAULTS if args.model else RANDOM_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    from attnplug.runner.commands.model_loading import read_hf_config

    common = dict(num_requests=args.num_requests, seed=args.seed, force_preemption=args.force_preemption,
                  dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, max_tokens=args.max_tokens,
                  block_size=args.block_size, backend=args.backend, async_scheduling=args.async_scheduling,
                  prefix_caching=args.prefix_caching, speculative=args.speculative)
    try:
        if args.model:
            from attnplug.runner.commands.parity_real import run_real_parity

            res = run_real_parity(args.model, **common)
        else:
            res = run_parity(read_hf_config(args.hf_config), **common)
    except AttnplugError as e:
        print(f"attnplug parity: {e}", file=sys.stderr)
        return 2
    print(res.line())
    return 0 if res.ok else 1
