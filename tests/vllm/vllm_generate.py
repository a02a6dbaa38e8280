"""Run vLLM offline generation in this process and print the greedy tokens as JSON.

``python vllm_generate.py SPEC.json`` (a subprocess of ``tests/vllm/``: vLLM binds
threads and keeps process-wide state, so it never runs inside the pytest process).

SPEC: ``{"model": DIR, "prompts": [[ids...]...], "max_tokens": N, "seed": S,
"engine": {LLM kwargs}}``. Which attention backend serves is the environment's choice
(``ATTNPLUG_VLLM_BACKEND``, read by attnplug's ``vllm.general_plugins`` entry point);
the backend class vLLM used is printed with the tokens.

vLLM's dummy loader fills every weight alike, which makes greedy output repeat one
token; the weights are re-drawn from a seeded generator (``LLM.apply_model``) so the
tokens depend on attention and differ between prompts.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: quick, no spawn


def redraw(seed: int):
    def apply(model):
        import torch

        g = torch.Generator().manual_seed(seed)
        names = []
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:  # norms: around 1
                p.data.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                std = 1.0 if "embed" in name else p.shape[-1] ** -0.5
                p.data.copy_(std * torch.randn(p.shape, generator=g))
            names.append(name)
        layers = [m for m in model.modules() if hasattr(m, "impl") and hasattr(m, "attn_backend")]
        return {"params": len(names), "impls": sorted({type(m.impl).__name__ for m in layers})}
    return apply


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              seed=spec["seed"], **spec["engine"])
    info = llm.apply_model(redraw(spec["seed"]))[0]
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    tokens = []
    for batch in spec.get("batches", [spec["prompts"]]):  # later batches hit the prefix cache of earlier ones
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    print("RESULT " + json.dumps({"tokens": tokens, **info}), flush=True)


if __name__ == "__main__":
    main()
