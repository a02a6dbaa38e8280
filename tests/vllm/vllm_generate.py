"""Run vLLM offline generation in this process and print the greedy tokens as JSON.

``python vllm_generate.py SPEC.json`` (a subprocess of ``tests/vllm/``: vLLM binds
threads and keeps process-wide state, so it never runs inside the pytest process).

SPEC: a list of jobs ``{"model": DIR, "batches": [[[ids...]...]...], "max_tokens": N, "seed": S,
"engine": {LLM kwargs}, "backends": [null, "torch_native", ...]}``. Each backend is
chosen as a user would: ``ATTNPLUG_VLLM_BACKEND`` and attnplug's ``vllm.general_plugins``
entry point (``register``); the impl classes vLLM built are printed with the tokens.

vLLM's dummy loader (``load_format="dummy"``) fills every weight alike, which makes greedy
output repeat one token; ``write_checkpoint`` saves seeded random weights as a real
checkpoint instead, which vLLM loads as it would any model.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: quick, no spawn


def write_checkpoint(model_dir: str, seed: int) -> int:
    """Save seeded random weights for ``model_dir/config.json`` as a Hugging Face checkpoint.

    Weights are drawn here, not re-drawn in the engine: vLLM's CPU linear layers repack
    their weights after loading, so later writes to the parameters would not reach the
    matmuls. The attention projections are drawn large and the MLP small, so that the
    tokens hinge on attention (the wrong-backend test relies on it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:  # norms: around 1
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                gain = 3.0 if "attn" in name else 0.3 if "mlp" in name else 1.0
                std = 1.0 if "embed" in name else gain * p.shape[-1] ** -0.5
                p.copy_(std * torch.randn(p.shape, generator=g))
    model.save_pretrained(model_dir, safe_serialization=True)
    return len(list(model.parameters()))


def generate(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, seed=spec["seed"],
              **spec["engine"])
    layers = llm.apply_model(lambda m: sorted({type(x.impl).__name__ for x in m.modules()
                                               if hasattr(x, "impl") and hasattr(x, "attn_backend")}))[0]
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    tokens = []
    for batch in spec["batches"]:  # a later batch hits the prefix cache of an earlier one
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    llm.llm_engine.engine_core.shutdown()
    return {"tokens": tokens, "impls": layers}


def run_jobs(jobs: list[dict]) -> list[dict]:
    """Each job's ``backends`` (``null``: vLLM's own choice), one engine each. Backends run
    in the order first listed, each on every job listing it, so every ``null`` runs
    before the first attnplug backend replaces vLLM's (a registration lasts the process)."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.v1.attention import selector

    for job in jobs:
        write_checkpoint(job["model"], job["seed"])
    order = list(dict.fromkeys(name for job in jobs for name in job["backends"]))
    assert order[0] is None or all(None not in job["backends"] for job in jobs), "vLLM's own backend goes first"
    results: list[dict] = [{} for _ in jobs]
    for name in order:
        if name is not None:
            os.environ["ATTNPLUG_VLLM_BACKEND"] = name
            from attnplug.plugins.vllm.entry import register

            register()  # what vLLM's plugin loader did for the first engine of the process
        for job, out in zip(jobs, results):
            if name in job["backends"]:
                selector._cached_get_attn_backend.cache_clear()  # vLLM memoises its choice per process
                out[str(name)] = generate(job)
                gc.collect()
                cleanup_dist_env_and_memory()
    return results


def main() -> None:
    """SPEC.json is a list of jobs (see the module docstring); prints one ``RESULT`` line."""
    print("RESULT " + json.dumps(run_jobs(json.load(open(sys.argv[1])))), flush=True)


if __name__ == "__main__":
    main()
