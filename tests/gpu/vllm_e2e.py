"""vLLM 0.33 end to end on a GPU: ``LLM.generate`` with attnplug backends selected through
the bridge against vLLM's own FLASH_ATTN on a tiny checkpoint, same greedy tokens.

``python tests/gpu/vllm_e2e.py [OUT.json]`` (``tests/gpu/run_all.sh`` section ``vllm_e2e``).
NEVER RUN YET: written while no GPU was lent (docs/vllm.md says so). It needs vLLM 0.33 in the
running Python with its CUDA kernels (``pip install vllm==0.33.0``); the project's device
machine has no network and the carried files are limited to 64 MiB (vLLM's wheel is 336 MB),
so there it exits 4 with that reason unless the machine's image gains vLLM.

What runs, in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one engine per backend:
a tiny Llama config (2 layers, 4 query / 2 KV heads of 64, float16, 16-token blocks) whose
seeded random weights ``tests/vllm/vllm_generate.write_checkpoint`` saves as a real
checkpoint; two batches of token-id prompts (38 and 71 tokens, chunked prefill at 32
tokens, prefix caching on: the second batch re-uses 32-token prefixes); 8 greedy tokens.
First vLLM's FLASH_ATTN (``attention_config={"backend": "FLASH_ATTN"}``), then each attnplug
backend as a user selects it: ``ATTNPLUG_VLLM_BACKEND=<name>``, attnplug's
``vllm.general_plugins`` entry point registering the bridge as ``CUSTOM``, and
``attention_config={"backend": "CUSTOM"}``.

Prints one ``RESULT`` JSON line (tokens and the impl classes vLLM built per backend) and
exits 0 when every attnplug backend gave FLASH_ATTN's tokens and the reference is not
degenerate; 1 on a mismatch (the first differing prompt and position are printed);
4 when vLLM 0.33 or CUDA is missing here.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "vllm"))  # vllm_generate.py

BACKENDS = ("triton", "torch_native")
"""attnplug backends run through the bridge (each declares float16, 16-token blocks, CUDA)."""

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "torch_dtype": "float16", "tie_word_embeddings": False, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_act": "silu"}
ENGINE = {"dtype": "float16", "max_model_len": 256, "block_size": 16, "enable_prefix_caching": True,
          "enable_chunked_prefill": True, "max_num_batched_tokens": 32, "gpu_memory_utilization": 0.2}
P1, P2 = list(range(3, 41)), list(range(50, 121))
BATCHES = [[P1, P2], [P1 + [200, 201, 202], P2[:33] + [7]]]


def _missing() -> str | None:
    """Why this cannot run here (``None``: it can)."""
    try:
        import torch
        import vllm
    except ImportError as exc:
        return f"vLLM is not installed in {sys.executable} ({exc}); pip install vllm==0.33.0"
    if not vllm.__version__.startswith("0.33."):
        return f"vLLM {vllm.__version__} is installed; this check is for 0.33"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def _generate(model: str, attention_backend: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, seed=0,
              attention_config={"backend": attention_backend}, **ENGINE)
    impls = llm.apply_model(lambda m: sorted({type(x.impl).__name__ for x in m.modules()
                                              if hasattr(x, "impl") and hasattr(x, "attn_backend")}))[0]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    tokens = [[list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in batch], sp,
                                                                     use_tqdm=False)] for batch in BATCHES]
    llm.llm_engine.engine_core.shutdown()
    del llm
    return {"tokens": tokens, "impls": impls}


def _first_difference(ref: list, got: list) -> str:
    for b, (rb, gb) in enumerate(zip(ref, got)):
        for p, (rp, gp) in enumerate(zip(rb, gb)):
            for t, (r, g) in enumerate(zip(rp, gp)):
                if r != g:
                    return f"batch {b} prompt {p} token {t}: FLASH_ATTN {r}, attnplug {g}"
    return "lengths differ"


def main() -> int:
    why = _missing()
    if why:
        print(f"vllm_e2e: not run: {why}", flush=True)
        return 4
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.v1.attention import selector
    from vllm_generate import write_checkpoint

    model = tempfile.mkdtemp(prefix="attnplug-vllm-e2e-")
    (pathlib.Path(model) / "config.json").write_text(json.dumps(LLAMA))
    write_checkpoint(model, seed=0)
    runs = {"FLASH_ATTN": _generate(model, "FLASH_ATTN")}
    gc.collect()
    cleanup_dist_env_and_memory()
    from attnplug.plugins.vllm.entry import register

    for name in BACKENDS:
        os.environ["ATTNPLUG_VLLM_BACKEND"], os.environ["ATTNPLUG_VLLM_TARGET"] = name, "CUSTOM"
        register()  # what vLLM's plugin loader did for the first engine of the process
        selector._cached_get_attn_backend.cache_clear()  # vLLM memoises its choice per process
        runs[name] = _generate(model, "CUSTOM")
        gc.collect()
        cleanup_dist_env_and_memory()
    print("RESULT " + json.dumps(runs), flush=True)
    if len(sys.argv) > 1:
        pathlib.Path(sys.argv[1]).write_text(json.dumps(runs, indent=1))
    ref = runs["FLASH_ATTN"]["tokens"]
    status = 0
    if len({tuple(t) for batch in ref for t in batch}) != 4:
        print(f"vllm_e2e: FLASH_ATTN's tokens are degenerate (prompts alike): {ref}")
        status = 1
    for name in BACKENDS:
        got = runs[name]
        if got["impls"] != [f"Attnplug_{name}_Impl"]:
            print(f"vllm_e2e: {name}: vLLM did not use the bridge: {got['impls']}")
            status = 1
        elif got["tokens"] != ref:
            print(f"vllm_e2e: {name}: tokens differ from FLASH_ATTN's ({_first_difference(ref, got['tokens'])})")
            status = 1
        else:
            print(f"vllm_e2e: {name} through the bridge == FLASH_ATTN: {sum(len(t) for b in ref for t in b)} tokens")
    return status


if __name__ == "__main__":
    sys.exit(main())
