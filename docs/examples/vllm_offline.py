"""An attnplug backend serving vLLM offline generation on the CPU (docs/vllm.md).

Run it where vLLM is installed (``make .venv-vllm/.test`` builds such an environment)::

    python docs/examples/vllm_offline.py                                   # vLLM's own attention
    ATTNPLUG_VLLM_BACKEND=torch_native python docs/examples/vllm_offline.py  # attnplug's, via the bridge

Both print the attention impl vLLM built and the greedy tokens; on vLLM's CPU build the
two runs print the same tokens. No download: the script writes a tiny Llama checkpoint
(random weights, seeded) and gives vLLM token ids, so no tokenizer is needed.

The settings that make vLLM run small on a CPU:

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process (no spawned
  engine process; quicker to start and easy to debug). Set before vLLM is imported.
* ``skip_tokenizer_init=True``: prompts are token ids, outputs are read as ids.
* ``enforce_eager=True``: no ``torch.compile`` and no graph capture.
* ``kv_cache_memory_bytes``: the KV cache's size in bytes, instead of a fraction of the
  machine's memory (vLLM's default reserves most of it).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before `import vllm`

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False, "bos_token_id": 1,
          "eos_token_id": 2, "hidden_act": "silu"}
PROMPTS = [list(range(3, 41)), list(range(50, 121)), [7, 9, 11, 13]]  # token ids: 38, 71 and 4 tokens


def write_checkpoint(model_dir: str, seed: int) -> None:
    """A Hugging Face checkpoint of :data:`CONFIG` with seeded random weights, attention
    weights large enough that the tokens depend on the attention backend."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:  # norm weights
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                gain = 3.0 if "attn" in name else 0.3 if "mlp" in name else 1.0
                p.copy_((1.0 if "embed" in name else gain * p.shape[-1] ** -0.5) * torch.randn(p.shape, generator=gen))
    model.save_pretrained(model_dir, safe_serialization=True)
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(CONFIG, f)


def generate(model_dir: str, max_tokens: int) -> dict:
    """Greedy tokens for :data:`PROMPTS` and the attention impl classes vLLM built."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256,
              block_size=32, max_num_batched_tokens=32,  # below the longest prompt: chunked prefill
              kv_cache_memory_bytes=8 << 20, seed=0)
    impls = llm.apply_model(lambda m: sorted({type(x.impl).__name__ for x in m.modules()
                                              if hasattr(x, "impl") and hasattr(x, "attn_backend")}))[0]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return {"impls": impls, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="where to write the checkpoint (default: a temporary folder)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args()
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="vllm-offline-")
    os.makedirs(model_dir, exist_ok=True)
    write_checkpoint(model_dir, args.seed)
    result = generate(model_dir, args.max_tokens)
    print(f"attention impl: {', '.join(result['impls'])}")
    for prompt, tokens in zip(PROMPTS, result["tokens"]):
        print(f"prompt of {len(prompt)} tokens -> {tokens}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
