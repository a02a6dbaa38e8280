"""Read a Llama-architecture GGUF file: its metadata as an HF ``config.json`` dict and its
tensors as an HF ``LlamaForCausalLM`` state dict (float32).

GGUF is llama.cpp's file format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md),
read here with the ``gguf`` package of the llama.cpp project (``GGUFReader``; tensor names
through its ``TensorNameMap``; quantised blocks through ``gguf.quants.dequantize``, which
gives float32). Supported tensor types: :data:`SUPPORTED_TYPES`.

Conventions undone here:

* **Shapes.** GGUF lists a tensor's dimensions innermost first (``ne[0]`` is the row
  length); the HF shape is that list reversed. ``GGUFReader`` already gives the bytes of a
  quantised tensor as ``(rows, bytes per row)``; dequantised, it is ``(rows, row length)``.
* **Q / K rows.** llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``)
  reorders the rows of ``q_proj`` and ``k_proj`` of every head from HF's "rotate half" RoPE
  layout (the first ``head_dim / 2`` rows pair with the last ``head_dim / 2``) to GGML's
  interleaved layout (rows ``2i`` and ``2i + 1`` pair): within each head, row ``i * 2 + j``
  of the file is HF row ``j * head_dim / 2 + i``. :func:`unpermute_rows` puts them back;
  ``attnplug parity --model smollm2`` and ``tests/runner/models/test_gguf_real_weights.py`` check
  the result against transformers' own GGUF loading and against the text it produces.
* **Tied embeddings.** A file without ``output.weight`` ties the LM head to
  ``token_embd.weight``: ``tie_word_embeddings = True`` and no ``lm_head.weight``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from attnplug.core.errors import AttnplugError

SUPPORTED_ARCHITECTURES = ("llama",)
"""``general.architecture`` values this loader reads."""

SUPPORTED_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
"""GGML tensor types dequantised (names of ``gguf.GGMLQuantizationType``); the quantised
ones are the block formats ``gguf.quants`` implements in numpy."""


class GGUFError(AttnplugError, ValueError):
    """A GGUF file that cannot be used: unreadable or truncated, an unsupported architecture
    or tensor type, missing metadata, tensors or tokenizer. The message is one line that
    starts with the file's path."""


class MissingPackageError(AttnplugError, ImportError):
    """A package that real-weight loading needs is not installed; the message is one line
    saying what to ``pip install``."""


def import_gguf():
    """The ``gguf`` package.

    Raises:
        MissingPackageError: it is not installed (names the extra to install).
    """
    try:
        import gguf
    except ImportError:
        raise MissingPackageError("reading GGUF files needs the gguf package: "
                                  "pip install 'attnplug[gguf]'") from None
    return gguf


def open_gguf(path: str):
    """``gguf.GGUFReader`` over ``path`` (memory-mapped; nothing is dequantised yet).

    Raises:
        GGUFError: the file is missing, not GGUF, or truncated / corrupt (the reader's own
            error, named).
        MissingPackageError: ``gguf`` is not installed.
    """
    gguf = import_gguf()
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(path)
        for t in reader.tensors:  # a truncated file gives short tensors: check every size
            want = int(np.prod([int(n) for n in t.shape]))
            if int(t.n_elements) != want or t.data.nbytes != int(t.n_bytes):
                raise ValueError(f"tensor {t.name} holds {t.data.nbytes} of its {int(t.n_bytes)} bytes")
    except (ValueError, KeyError, IndexError, OSError, TypeError, OverflowError, UnicodeDecodeError) as e:
        text = " ".join(str(e).split()) or type(e).__name__
        raise GGUFError(f"{path}: not a readable GGUF file (truncated or corrupt?): {text[:200]}") from None
    return reader


def field(reader, key: str, default: Any = None) -> Any:
    """Metadata value ``key`` (a Python scalar, str or list), ``default`` when absent."""
    f = reader.get_field(key)
    if f is None:
        return default
    value = f.contents()
    return value


def _required(reader, path: str, key: str) -> Any:
    value = field(reader, key)
    if value is None:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return value


def hf_config(reader, path: str) -> dict[str, Any]:
    """The HF ``config.json`` dict (``model_type: llama``) the file's metadata describes.

    Raises:
        GGUFError: an architecture not in :data:`SUPPORTED_ARCHITECTURES`, a required
            ``llama.*`` key missing, or RoPE scaling (not supported).
    """
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    a = arch
    scaling = field(reader, f"{a}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"{path}: RoPE scaling {scaling!r} is not supported")
    hidden = int(_required(reader, path, f"{a}.embedding_length"))
    heads = int(_required(reader, path, f"{a}.attention.head_count"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = field(reader, f"{a}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise GGUFError(f"{path}: neither {a}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size")
    names = {t.name for t in reader.tensors}
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, path, f"{a}.feed_forward_length")),
        "num_hidden_layers": int(_required(reader, path, f"{a}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, f"{a}.attention.head_count_kv", heads)),
        "head_dim": int(field(reader, f"{a}.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(field(reader, f"{a}.context_length", 2048)),
        "rms_norm_eps": float(field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field(reader, f"{a}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos", "padding"):
        tid = field(reader, f"tokenizer.ggml.{key}_token_id")
        if tid is not None:
            cfg[f"{'pad' if key == 'padding' else key}_token_id"] = int(tid)
    return cfg


def hf_tensor_names(cfg: dict[str, Any]) -> list[str]:
    """The HF ``LlamaForCausalLM`` parameter names of ``cfg`` (without a tied ``lm_head``)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg["tie_word_embeddings"]:
        names.append("lm_head.weight")
    per_layer = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
    for i in range(cfg["num_hidden_layers"]):
        names += [f"model.layers.{i}.{p}.weight" for p in per_layer]
    return names


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (module docstring): ``w`` is ``(n_head * head_dim,
    hidden)`` in GGML's interleaved RoPE order; the result is in HF's rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantised(gguf, t, path: str) -> np.ndarray:
    kind = t.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GGUFError(f"{path}: tensor {t.name} has type {kind}, not supported (supported: "
                        f"{', '.join(SUPPORTED_TYPES)})")
    shape = tuple(int(n) for n in reversed(t.shape))
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)


def hf_state_dict(reader, path: str, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantised to float32 under its HF name, Q / K rows put
    back in HF order (:func:`unpermute_rows`).

    Raises:
        GGUFError: a tensor missing, of an unsupported type, or of the wrong shape.
    """
    gguf = import_gguf()
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    by_name = {t.name: t for t in reader.tensors}
    hd, hidden = cfg["head_dim"], cfg["hidden_size"]
    out: dict[str, torch.Tensor] = {}
    for hf_name in hf_tensor_names(cfg):
        name = tmap.get_name(hf_name, try_suffixes=(".weight",))  # keeps the suffix: "blk.0.attn_q.weight"
        if name not in by_name:
            raise GGUFError(f"{path}: tensor {name} (HF {hf_name}) is missing")
        w = _dequantised(gguf, by_name[name], path)
        if ".q_proj." in hf_name:
            want, heads = (cfg["num_attention_heads"] * hd, hidden), cfg["num_attention_heads"]
        elif ".k_proj." in hf_name:
            want, heads = (cfg["num_key_value_heads"] * hd, hidden), cfg["num_key_value_heads"]
        else:
            want, heads = None, 0
        if want is not None:
            if w.shape != want:
                raise GGUFError(f"{path}: tensor {name} has shape {list(w.shape)}, expected {list(want)}")
            w = unpermute_rows(w, heads)
        out[hf_name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # a copy: the file stays read-only
    return out


__all__ = ["GGUFError", "MissingPackageError", "SUPPORTED_ARCHITECTURES", "SUPPORTED_TYPES", "field", "hf_config",
           "hf_state_dict", "hf_tensor_names", "import_gguf", "open_gguf", "unpermute_rows"]
