"""The comparison behind ``attnplug parity``: run prompts through our engine and compare each
request's greedy tokens and logits with a reference (HF transformers). Shared by the random-weight
parity (``parity.py``) and the real-weight one (``parity_real.py``).

Tolerances on ``max |dlogit|`` (absolute, logits of the whole vocabulary), per dtype:
``float32`` 2e-3, ``bfloat16`` 0.5, ``float16`` 0.1. Tokens must be identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

TOLERANCES = {torch.float32: 2e-3, torch.bfloat16: 0.5, torch.float16: 0.1}
FP8_MIN_AGREEMENT = 0.25
"""With an fp8 KV cache, the share of the reference's greedy tokens ours must reproduce
(each request up to its first divergence): a floor that catches a broken fp8 path (wrong or
ignored scales reproduce almost nothing), not a quality bar: an fp8 cache perturbs every
logit (SmolLM2-135M: mean |dlogit| about 0.3, docs/performance.md), so greedy decoding
drifts from the fp32 cache's after a while (SmolLM2, fp8_e4m3: 58% of 4 x 64 tokens, 32% of
4 x 256, where one request diverges at its first token). The logits error is reported, not bounded."""
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
    kv_cache: dict[str, Any] = field(default_factory=dict)
    """With an fp8 ``--kv-cache-dtype``: ``dtype``, ``scales``, ``granularity``, and the
    measured ``token_agreement`` (generated tokens equal to the reference's before each
    request's first divergence, over all reference tokens), ``agreeing_tokens`` /
    ``reference_tokens`` and ``mean_abs_dlogit`` over the agreeing positions
    (``max_abs_dlogit`` is over them too). Tokens need not be identical then: the run is OK
    when ``token_agreement >= FP8_MIN_AGREEMENT``."""

    def _spec_part(self) -> str:
        s = self.spec
        return f", {s['accepted']}/{s['proposed']} drafts accepted" if s else ""

    def line(self) -> str:
        if self.kv_cache:
            k = self.kv_cache
            return (f"parity: {'OK' if self.ok else 'FAIL'} {k['dtype']} KV cache ({k['scales']} scales, "
                    f"{k['granularity']}): {k['agreeing_tokens']}/{k['reference_tokens']} greedy tokens agree with the "
                    f"reference ({k['token_agreement']:.1%}; {self.num_identical}/{self.num_requests} requests "
                    f"identical), |dlogit| max {self.max_abs_dlogit:.3g} mean {k['mean_abs_dlogit']:.3g} over the "
                    f"agreeing positions (needs >= {FP8_MIN_AGREEMENT:.0%} agreement)")
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


PROMPT_LEN_RANGE = (3, 40)
"""Default ``[lo, hi]`` prompt lengths of a random-weight parity run (``parity.run_parity``)."""


def parity_max_model_len(prompt_len_range: tuple[int, int], max_tokens: int, block_size: int) -> int:
    """The engine's ``max_model_len`` of a parity run: the longest prompt, its tokens, a block."""
    return int(prompt_len_range[1] + max_tokens + block_size)


def engine_args(num_requests: int, *, backend: str | None, block_size: int, seed: int, max_model_len: int,
                max_num_batched_tokens: int, force_preemption: bool = False, async_scheduling: bool = False,
                prefix_caching: bool = False, speculative: str | None = None, kv_cache_dtype: str = "auto",
                kv_scales: str = "first_batch") -> SimpleNamespace:
    """The options ``build_engine`` reads for a parity run of ``num_requests`` prompts (every
    tensor-parallel rank builds its engine from the same ones: ``parity_parallel.py``)."""
    return SimpleNamespace(
        model=None, backend=backend, block_size=block_size, seed=seed, max_model_len=max_model_len,
        max_num_seqs=num_requests, max_num_batched_tokens=max_num_batched_tokens, num_blocks=None,
        force_preemption_every=3 if force_preemption else None, record_logits=True,
        async_scheduling=async_scheduling, prefix_caching=prefix_caching, speculative=speculative,
        kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)


def compare_with_reference(model, prompts: dict[str, list[int]], reference, tdtype: torch.dtype, *,
                           backend: str | None, block_size: int, seed: int, max_model_len: int,
                           max_num_batched_tokens: int, max_tokens: int, force_preemption: bool = False,
                           async_scheduling: bool = False, prefix_caching: bool = False,
                           speculative: str | None = None, stop_token_ids: tuple[int, ...] = (),
                           kv_cache_dtype: str = "auto", kv_scales: str = "first_batch",
                           mm_features: dict | None = None) -> ParityResult:
    """Run ``prompts`` (request id -> token ids) through our engine on ``model`` (greedy,
    ``max_tokens`` each, the given scheduling options), then compare each request's tokens
    and logits with ``reference(prompt) -> (tokens, logits per token)``.

    With ``stop_token_ids`` a request may stop early: its tokens must then equal the
    reference's up to and including the stop token. With an fp8 ``kv_cache_dtype`` the
    result measures agreement instead of demanding identity (``ParityResult.kv_cache``).
    With ``mm_features`` (request id -> its images) each request is added with its images and
    the reference is called as ``reference(req_id, prompt)``."""
    from attnplug.runner.commands.assemble import build_engine
    from attnplug.runner.step.scheduler_output import SamplingParams

    args = engine_args(len(prompts), backend=backend, block_size=block_size, seed=seed, max_model_len=max_model_len,
                       max_num_batched_tokens=max_num_batched_tokens, force_preemption=force_preemption,
                       async_scheduling=async_scheduling, prefix_caching=prefix_caching, speculative=speculative,
                       kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)
    setup = build_engine(args, model=model, requests=False)
    for rid, p in prompts.items():
        setup.engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                        stop_token_ids=stop_token_ids),
                                 **({"mm_features": mm_features[rid]} if mm_features else {}))
    results = setup.engine.run()

    tol = TOLERANCES[tdtype]
    max_d = sum_d = 0.0
    identical = agreeing = ref_total = compared = 0
    first = None
    for rid, prompt in prompts.items():
        ours = results[rid]
        ref_tokens, ref_logits = reference(rid, prompt) if mm_features else reference(prompt)
        cut = next((j + 1 for j, t in enumerate(ref_tokens) if t in stop_token_ids), len(ref_tokens))
        ref_tokens, ref_logits = ref_tokens[:cut], ref_logits[:cut]
        same = ours.output_token_ids == ref_tokens
        identical += same
        prefix = next((j for j, (a, b) in enumerate(zip(ours.output_token_ids, ref_tokens)) if a != b),
                      min(len(ours.output_token_ids), len(ref_tokens)))
        agreeing, ref_total = agreeing + prefix, ref_total + len(ref_tokens)
        # logits of positions with the same context: up to and including the first divergence
        for j, (a, b) in enumerate(zip(ours.logits[:prefix + 1], ref_logits[:prefix + 1])):
            d = (a.float() - b.float()).abs()
            max_d, sum_d, compared = max(max_d, float(d.max())), sum_d + float(d.mean()), compared + 1
        if not same and first is None:
            j = next((j for j, (a, b) in enumerate(zip(ours.output_token_ids, ref_tokens)) if a != b),
                     min(len(ours.output_token_ids), len(ref_tokens)))
            first = {"request": rid, "prompt_len": len(prompt), "output_step": j,
                     "ours": ours.output_token_ids[j] if j < len(ours.output_token_ids) else None,
                     "hf": ref_tokens[j] if j < len(ref_tokens) else None}
    fp8 = kv_cache_dtype != "auto"
    agreement = agreeing / max(ref_total, 1)
    ok = agreement >= FP8_MIN_AGREEMENT if fp8 else identical == len(prompts) and max_d <= tol
    if first is None and not ok:
        first = {"reason": f"max |dlogit| {max_d:.3g} above tolerance {tol:g}"}
    st = setup.engine.scheduler.spec
    spec = {"proposed": st.stats.num_draft_tokens, "accepted": st.stats.num_accepted_tokens} if st else {}
    res = ParityResult(ok, identical, len(prompts), max_d, tol, first,
                       preemptions=setup.engine.scheduler.num_preemptions, steps=setup.engine.stats.num_steps,
                       spec=spec)
    if fp8:
        res.kv_cache = {**setup.kv_cache, "token_agreement": agreement, "agreeing_tokens": agreeing,
                        "reference_tokens": ref_total, "mean_abs_dlogit": sum_d / max(compared, 1)}
    stats = getattr(setup.engine.scheduler.kv_cache_manager, "stats", None)
    if prefix_caching and stats is not None:
        res.prefix_cache_hits = stats.hits
        res.prefix_cache_hit_requests = stats.hit_requests
    res.cascade_steps = setup.engine.runner.num_cascade_steps if hasattr(setup.engine.runner, "num_cascade_steps") else 0
    return res


__all__ = ["DTYPES", "FP8_MIN_AGREEMENT", "TOLERANCES", "ParityResult", "PROMPT_LEN_RANGE", "compare_with_reference",
           "engine_args", "parity_max_model_len"]
