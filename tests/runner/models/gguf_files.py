"""Small GGUF files written with the ``gguf`` package's own writer, for the loader's tests.

:func:`write_tiny_llama` writes a 2-layer Llama whose HF weights are known: q / k rows are
stored in llama.cpp's order (``ggml_order``, written here from the convention stated in
``runner/models/gguf/reader.py``), other tensors as they are, each in a chosen GGML type.
"""

from __future__ import annotations

import numpy as np

CFG = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 96, "layers": 2}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def ggml_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> GGML interleaved rows: within a head, file row ``2i + j`` is HF
    row ``j * head_dim / 2 + i``."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_vocab() -> list[str]:
    """Special tokens, the 256 byte-level symbols and one merge's result (``Ġt``)."""
    import tokenizers

    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet()) + ["Ġt"]


def hf_weights(vocab: int, seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """Random HF ``LlamaForCausalLM`` weights (float32) of :data:`CFG`."""
    rng = np.random.default_rng(seed)
    h, hd, f = CFG["hidden"], CFG["head_dim"], CFG["ffn"]

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": 1 + w(h)}
    if not tied:
        out["lm_head.weight"] = w(vocab, h)
    for i in range(CFG["layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": w(CFG["heads"] * hd, h),
                    p + "self_attn.k_proj.weight": w(CFG["kv_heads"] * hd, h),
                    p + "self_attn.v_proj.weight": w(CFG["kv_heads"] * hd, h),
                    p + "self_attn.o_proj.weight": w(h, CFG["heads"] * hd),
                    p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h),
                    p + "mlp.down_proj.weight": w(h, f),
                    p + "input_layernorm.weight": 1 + w(h), p + "post_attention_layernorm.weight": 1 + w(h)})
    return out


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf: str) -> str:
    """The GGUF tensor name of HF parameter ``hf`` (llama.cpp's naming)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".")  # model.layers.I.<inner>.weight
    return f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.weight"


def write_tiny_llama(path, *, arch: str = "llama", qtype: str = "Q8_0", tokenizer: bool = True, tied: bool = True,
                     seed: int = 0) -> dict[str, np.ndarray]:
    """Write the tiny model to ``path``; returns its HF weights as the file holds them
    (quantised tensors: their dequantised values)."""
    import gguf

    vocab = byte_vocab()
    hf = hf_weights(len(vocab), seed, tied)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_vocab_size(len(vocab))
    w.add_block_count(CFG["layers"])
    w.add_context_length(256)
    w.add_embedding_length(CFG["hidden"])
    w.add_feed_forward_length(CFG["ffn"])
    w.add_head_count(CFG["heads"])
    w.add_head_count_kv(CFG["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(CFG["head_dim"])
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(vocab)
        w.add_token_types([3, 3, 3] + [1] * (len(vocab) - 3))
        w.add_token_merges(["Ġ t"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(TEMPLATE)
    held = {}
    kind = gguf.GGMLQuantizationType[qtype]
    for name, value in hf.items():
        if value.ndim == 1:  # norms stay float32, as llama.cpp writes them
            w.add_tensor(gguf_name(name), value)
            held[name] = value
            continue
        stored = value
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            stored = ggml_order(value, CFG["heads"] if "q_proj" in name else CFG["kv_heads"])
        w.add_tensor(gguf_name(name), gguf.quants.quantize(stored, kind), raw_dtype=kind)
        # quantisation blocks run along a row, so reordering rows commutes with it
        held[name] = gguf.quants.dequantize(gguf.quants.quantize(value, kind), kind).reshape(value.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held
