"""``attnplug parity --model smollm2`` (or ``--model PATH.gguf``): our engine against HF
transformers' ``generate`` on the same real weights.

Both sides get the same dequantised float32 weights (``runner/models/gguf``): HF's
``LlamaForCausalLM`` (``attn_implementation="eager"``) loads the state dict the loader
produced, our model loads it too. The prompts are the first ``num_requests`` of the bundled
prompt set (``runner/data/prompts.jsonl``) through the file's chat template; both sides
decode greedily for ``max_tokens`` tokens or until the EOS token. Our engine runs them
together under the chosen scheduling options (chunked prefill under a small token budget,
forced preemption, prefix caching, speculation, async scheduling), HF one request at a
time; tokens must be identical and logits within ``parity.TOLERANCES``.

That HF and we agree shows the engine is right for these weights; that the weights are
right (dequantisation, the Q / K row order of ``gguf/reader.py``) is shown by the text they
produce (``tests/runner/models/test_gguf_real_weights.py``) and by transformers' own GGUF loader.
"""

from __future__ import annotations

import torch

from attnplug.core.errors import AttnplugError
from attnplug.runner.commands.parity_compare import DTYPES, ParityResult, compare_with_reference


def hf_llama(config: dict, state_dict: dict[str, torch.Tensor], dtype: torch.dtype):
    """HF ``LlamaForCausalLM`` of ``config`` holding ``state_dict`` (strictly), eager
    attention, eval mode.

    Raises:
        AttnplugError: transformers is not installed.
    """
    try:
        import transformers
    except ImportError:
        raise AttnplugError("attnplug parity needs transformers: pip install 'attnplug[parity]'") from None
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "torch_dtype"})
    major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    kw = {"dtype": dtype} if major_minor >= (4, 56) else {"torch_dtype": dtype}
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", **kw)
    sd = dict(state_dict)
    if config.get("tie_word_embeddings"):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    hf.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    return hf.eval()


@torch.inference_mode()
def hf_generate(hf, prompt: list[int], max_tokens: int, eos: int | None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits that chose them, from HF ``generate``."""
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=max_tokens, min_new_tokens=0, do_sample=False, eos_token_id=eos,
                      pad_token_id=eos if eos is not None else 0, output_logits=True,
                      return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [lg[0].float() for lg in out.logits][: len(tokens)]


def run_real_parity(model: str, *, num_requests: int = 8, max_tokens: int = 8, dtype: str = "float32",
                    max_num_batched_tokens: int = 64, block_size: int = 16, backend: str | None = None,
                    seed: int = 0, force_preemption: bool = False, async_scheduling: bool = False,
                    prefix_caching: bool = False, speculative: str | None = None,
                    kv_cache_dtype: str = "auto", kv_scales: str = "first_batch") -> ParityResult:
    """Run the comparison (module docstring) for ``model`` (``smollm2`` or a ``.gguf`` path).

    Raises:
        GGUFError, MissingPackageError: the model cannot be loaded (one line).
        AttnplugError: transformers missing, bad options.
    """
    from attnplug.runner.commands.assemble import resolve_backend
    from attnplug.runner.commands.model_loading import build_with_backends
    from attnplug.runner.commands.text_prompts import cycled, load_prompts
    from attnplug.runner.models.gguf import load_gguf

    if dtype not in DTYPES:
        raise AttnplugError(f"dtype {dtype!r} not supported; choose one of {sorted(DTYPES)}")
    tdtype = DTYPES[dtype]
    real = load_gguf(model)
    from attnplug.core.kv_quant import parse_kv_cache_dtype

    ours = build_with_backends(real.config, backend=backend, block_size=block_size, resolve=resolve_backend,
                               dtype=tdtype, seed=None, init=False, kv_cache_dtype=parse_kv_cache_dtype(kv_cache_dtype))
    ours.load_hf_state_dict(real.state_dict)
    hf = hf_llama(real.config, real.state_dict, tdtype)
    tok = real.tokenizer
    prompts = {f"req-{i}": tok.encode_chat(list(tp.messages))
               for i, tp in enumerate(cycled(load_prompts(None), num_requests))}
    eos = tok.eos_token_id
    longest = max(len(p) for p in prompts.values())
    return compare_with_reference(
        ours, prompts, lambda p: hf_generate(hf, p, max_tokens, eos), tdtype, backend=backend,
        block_size=block_size, seed=seed, max_model_len=longest + max_tokens + block_size,
        max_num_batched_tokens=max_num_batched_tokens, max_tokens=max_tokens, force_preemption=force_preemption,
        async_scheduling=async_scheduling, prefix_caching=prefix_caching, speculative=speculative,
        stop_token_ids=(eos,) if eos is not None else (), kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)


__all__ = ["hf_generate", "hf_llama", "run_real_parity"]
