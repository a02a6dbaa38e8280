"""The vLLM side of ``attnplug bench engine``: run in a subprocess with the Python of an
environment that has vLLM (``.venv-vllm/0.32/bin/python``), never in attnplug's process
(vLLM binds threads and keeps process-wide state).

``python -m attnplug.runner.commands.bench.engine_vllm SPEC.json --serve`` reads a spec
written by ``bench/engine.py``::

    {"model": DIR,                 # an HF checkpoint (config.json + model.safetensors)
     "prompts": [[ids...], ...],   # token ids, one list per request
     "max_tokens": [N, ...],       # per request (greedy, EOS ignored)
     "engine": {LLM kwargs},       # max_num_seqs, max_num_batched_tokens, block_size, ...
     "seed": S}

starts one ``LLM`` (float32; threads from ``OMP_NUM_THREADS``, which the parent sets), runs
one warm-up ``generate`` of the requests (vLLM's compilation and first-touch costs stay out
of the figures), then answers each ``run`` line on stdin with one measured ``generate``
(:func:`serve`). ``steps`` are calls of the model's ``forward`` and ``forward_s`` their summed
wall time: the model body without the LM head and the sampler, as attnplug's ``forward`` stage.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _timed_forward(llm) -> list[float]:
    """Wrap the model's ``forward`` (in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    so each call appends its wall seconds to the returned list."""
    durations: list[float] = []

    def wrap(model):
        inner = model.forward

        def forward(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            durations.append(time.perf_counter() - t0)
            return out

        model.forward = forward
        return type(model).__name__

    llm.apply_model(wrap)
    return durations


def serve(spec: dict, commands, out) -> None:
    """Start vLLM's engine for ``spec``, run one warm-up ``generate``, print ``READY {json}``
    (``torch_threads``, ``vllm_version``); then per ``run`` line of ``commands`` one measured
    ``generate`` and ``RUN {json}`` (``wall_s``, ``steps``, ``forward_s``,
    ``generated_tokens``, ``load_average_1m``, ``tokens``); ``quit`` (or the end) stops."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], skip_tokenizer_init=True, seed=spec["seed"], dtype=spec.get("dtype", "float32"),
              **spec["engine"])
    durations = _timed_forward(llm)
    requests = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
              for m in spec["max_tokens"]]
    llm.generate(requests, params, use_tqdm=False)  # warm-up
    _emit(out, "READY", {"torch_threads": torch.get_num_threads(), "vllm_version": vllm.__version__})
    for line in commands:
        if line.strip() != "run":
            break
        durations.clear()
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        _emit(out, "RUN", {"wall_s": wall, "steps": len(durations), "forward_s": sum(durations),
                           "generated_tokens": sum(len(t) for t in tokens), "load_average_1m": load,
                           "tokens": tokens})
    llm.llm_engine.engine_core.shutdown()


def _emit(out, tag: str, payload: dict) -> None:
    out.write(f"{tag} {json.dumps(payload)}\n")
    out.flush()


def main() -> None:
    """``SPEC.json --serve``: :func:`serve` on stdin / stdout (module docstring)."""
    spec = json.load(open(sys.argv[1], encoding="utf-8"))
    serve(spec, sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
