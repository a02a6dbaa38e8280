"""Building blocks of the Llama family: RMSNorm, SwiGLU MLP, and the attention layer (RoPE
lives in :mod:`attnplug.runner.models.rope`; ``RotaryEmbedding`` is re-exported here).

Numerics follow HF transformers' eager Llama code (the parity reference): RMSNorm in
float32; RoPE as ``rope.py`` documents.

The attention layer has exactly one attention path: its backend's ``AttentionImpl``,
called directly in eager mode and through the ``attnplug::attention`` custom op while
``torch.compile`` traces (``attention_op.attend``).
"""

from __future__ import annotations

import torch
from torch import nn

from attnplug.core.contracts import AttentionBackend, AttentionType
from attnplug.core.errors import MetadataError
from attnplug.runner.models import cpu_ops, silu_mul
from attnplug.runner.models.attention_op import attend
from attnplug.runner.models.cpu_linear import Linear
from attnplug.runner.models.fused import FusedProjections
from attnplug.runner.models.impls import make_impl
from attnplug.runner.models.rope import RotaryEmbedding


def merge_embeds(embedded: torch.Tensor, inputs_embeds: torch.Tensor | None,
                 is_embed: torch.Tensor | None) -> torch.Tensor:
    """The first layer's input: ``embedded`` (``[T, hidden_size]``, the embedding of
    ``input_ids``) with rows ``is_embed`` (``[T]`` bool) taken from ``inputs_embeds``
    (``[T, hidden_size]``, prompt embeddings; ``runner/step/prompt_embeds.py``).
    ``inputs_embeds is None`` returns ``embedded`` unchanged (text-only steps)."""
    if inputs_embeds is None:
        return embedded
    return torch.where(is_embed.unsqueeze(-1), inputs_embeds.to(embedded.dtype), embedded)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, the statistic in float32 (HF ``LlamaRMSNorm``)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[num_tokens, hidden_size]``; returns the same shape and dtype."""
        h = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # one fused kernel, same formula
        return self.weight * h.to(x.dtype)


class SwiGLUMLP(FusedProjections, nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` (HF ``LlamaMLP``); ``gate_proj`` and
    ``up_proj`` run as one matmul over their stacked rows (``fused.py``: buffer
    ``gate_up_weight`` ``[2 * intermediate_size, hidden_size]``, gate rows first)."""

    fused_parts = {"gate_up": ("gate_proj", "up_proj")}

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        kw = dict(bias=bias, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, **kw)
        self.fuse_projections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden_size]`` -> the same shape and dtype."""
        gate, up = self.project("gate_up", x)
        fused = silu_mul.maybe_silu_mul(gate, up)  # one C pass, torch's bits, where it takes them (silu_mul.py)
        if fused is not None:
            return self.down_proj(fused)
        # the product into silu's fresh output: one [num_tokens, intermediate_size] buffer, not two
        # (the same bytes as ``silu(gate) * up``); under autograd the out-of-place form
        act = nn.functional.silu(gate)
        return self.down_proj(act * up if torch.is_grad_enabled() else act.mul_(up))


class Attention(FusedProjections, nn.Module):
    """Self-attention of one decoder layer: q/k/v/o projections, RoPE, backend impl.

    The HF parameter names (``q_proj``... ``o_proj``, and ``sinks`` with ``sinks=True``:
    gpt-oss's ``[num_heads]`` sink logits, float32, handed to the impl) live here so that a
    state dict ``model.layers.N.self_attn.*`` loads directly. ``layer_name`` keys the per-layer KV
    cache and metadata dicts. ``q_proj``, ``k_proj`` and ``v_proj`` run as one matmul over
    their stacked rows (``fused.py``: buffer ``qkv_weight``, q rows, then k, then v); the
    impl gets ``v`` as a strided column view of that output (row stride ``(H + 2K) * D``,
    as vLLM's backends do), ``q`` and ``k`` as RoPE's fresh tensors.
    """

    fused_parts = {"qkv": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, layer_name: str, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_size: int, rope: RotaryEmbedding, backend: type[AttentionBackend],
                 qkv_bias: bool, o_bias: bool, sliding_window: int | None, dtype: torch.dtype,
                 device: torch.device | str, sinks: bool = False):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.layer_name = layer_name
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.q_proj = nn.Linear(hidden_size, num_heads * head_size, bias=qkv_bias, **kw)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_size, bias=qkv_bias, **kw)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_size, bias=qkv_bias, **kw)
        self.o_proj = Linear(num_heads * head_size, hidden_size, bias=o_bias, **kw)
        self.rope = rope
        self.backend = backend
        self.sliding_window = sliding_window
        extra = {}
        if sinks:  # gpt-oss: [num_heads] float32 sink logits (the impl shares their storage)
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32, device=device))
            extra["sinks"] = self.sinks.detach()
        self.impl = make_impl(
            backend, layer_name, num_heads, head_size, head_size ** -0.5, num_kv_heads, sliding_window=sliding_window,
            logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_cache_dtype=dtype, **extra)
        self.fuse_projections()

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``.

        Writes this step's K/V into ``kv_cache`` (through the impl) and attends.
        """
        n = hidden.shape[0]
        qkv = self.project_joined("qkv", hidden)
        cos, sin = self.cos_sin(positions, hidden.dtype)
        if self.fuses_qk_rope() and cpu_ops.enabled() and cpu_ops.takes(qkv):
            rope = self.rope  # q and k roped from qkv's columns in place (cpu_ops.rope_qk)
            q, k = cpu_ops.rope_qk(qkv, self.num_heads, self.num_kv_heads, self.head_size, cos, sin,
                                   rope.rotary_dim, rope.interleaved)
            v = qkv[:, (self.num_heads + self.num_kv_heads) * self.head_size:].view(n, self.num_kv_heads,
                                                                                   self.head_size)
        else:
            q, k, v = self.qkv_roped(qkv, cos, sin)
        # every real row is written by the impl; padded rows (CUDA graphs) stay zero
        real = getattr(attn_metadata, "num_actual_tokens", None) == n
        out = torch.empty_like(q) if real else torch.zeros_like(q)
        attend(self, q, k, v, kv_cache, attn_metadata, out)
        return self.o_proj(out.view(n, self.num_heads * self.head_size))

    def fuses_qk_rope(self) -> bool:
        """Whether q and k may go straight from the fused projection's output to RoPE
        (``cpu_ops.rope_qk``): no per-head normalisation comes between (:meth:`normalize_qk` is
        this class's, not an override such as Qwen3's). Decided once per layer."""
        ok = self.__dict__.get("_fuses_qk_rope")
        if ok is None:
            ok = self.__dict__["_fuses_qk_rope"] = type(self).normalize_qk is Attention.normalize_qk
        return ok

    def qkv_roped(self, qkv: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv`` ``[n, (H + 2K) * D]`` (the fused projection's output) -> ``q`` ``[n, H, D]``,
        ``k`` and ``v`` ``[n, K, D]``: q and k normalised (:meth:`normalize_qk`) and roped
        (``cpu_ops.rope`` where it takes them, else ``RotaryEmbedding.apply``), v a column view."""
        n = qkv.shape[0]
        q, k, v = qkv.split(self.fused_sizes["qkv"], dim=-1)
        q = q.view(n, self.num_heads, self.head_size)
        k = k.view(n, self.num_kv_heads, self.head_size)
        v = v.view(n, self.num_kv_heads, self.head_size)
        q, k = self.normalize_qk(q, k)
        if cpu_ops.enabled() and cpu_ops.takes(q) and cpu_ops.takes(k):  # one pass each (cpu_ops.py)
            rope = self.rope
            q = cpu_ops.rope(q, cos, sin, rope.rotary_dim, rope.interleaved)
            k = cpu_ops.rope(k, cos, sin, rope.rotary_dim, rope.interleaved)
        else:
            q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        return q, k, v

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``self.rope.cos_sin(positions, dtype)``, computed once per step for all the layers
        sharing this rope: the model hands every layer the same ``positions`` tensor object,
        so the last result is reused while that object (held by the cache, so never
        recycled) and ``dtype`` are the same. Not cached while ``torch.compile`` traces.

        A CUDA-graph capture (``runner/execute/cudagraph_capture.py``) runs the forward
        eagerly first, then again under capture with the same ``positions`` object: the
        entry is keyed on whether the stream is capturing too, so the capture computes
        cos/sin inside the graph (a hit on the eager entry would bake the capture step's
        positions into every replay)."""
        if torch.compiler.is_compiling():
            return self.rope.cos_sin(positions, dtype)
        capturing = stream_capturing(positions)
        cached = self.rope.__dict__.get("_step_cos_sin")
        if cached is not None and cached[0] is positions and cached[1] == dtype and cached[2] == capturing:
            return cached[3]
        cos_sin = self.rope.cos_sin(positions, dtype)
        self.rope.__dict__["_step_cos_sin"] = (positions, dtype, capturing, cos_sin)
        return cos_sin

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k normalisation before RoPE: none here (Qwen3 overrides it).
        ``q`` ``[num_tokens, num_heads, head_size]``, ``k`` ``[num_tokens, num_kv_heads, head_size]``."""
        return q, k


def stream_capturing(positions: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``positions``'
    device (always ``False`` for a CPU tensor; ``torch.cuda`` is not asked then)."""
    return positions.is_cuda and torch.cuda.is_current_stream_capturing()


def lookup_layer(mapping, layer_name: str, what: str):
    """``mapping[layer_name]`` or a :class:`MetadataError` naming the missing layer."""
    try:
        return mapping[layer_name]
    except KeyError:
        raise MetadataError(
            f"{what} has no entry for attention layer {layer_name!r} (it has {len(mapping)} entries): "
            f"pass one per layer, keyed by the names in model.layer_names.") from None


def lookup_metadata(attn_metadata, layer_name: str):
    """:func:`lookup_layer` of ``attn_metadata`` in eager mode; ``None`` while ``torch.compile``
    traces: the compiled ops read the metadata from the forward context
    (``attention_op.forward_context``), and Dynamo, never reading it, adds no guards on it."""
    if torch.compiler.is_compiling():
        return None
    return lookup_layer(attn_metadata, layer_name, "attn_metadata")
