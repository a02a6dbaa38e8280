"""Attention-sink math shared by the backends (the contract: ``core/contracts.AttentionImpl``).

A sink is one extra logit ``s_h`` per query head in the softmax denominator that carries
no value (gpt-oss; vLLM's ``sinks``; FlashInfer's ``sinks`` argument)::

    p_k = exp(l_k) / (exp(s_h) + sum_j exp(l_j))        out = sum_k p_k v_k

Two equivalent ways to apply it, both here:

* :func:`softmax_with_sinks` — the dense form: append the sink as a last logit column,
  softmax, drop the column (what the torch_native reference does);
* :func:`fold_sinks` — after an attention that returns its natural-log LSE ``L`` (sum over
  the real keys): ``out_with_sink = out * exp(L) / (exp(L) + exp(s)) = out * sigmoid(L - s)``
  (what a cascade merge does after combining the prefix and suffix passes).
"""

from __future__ import annotations

import torch


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim with one sink logit per row in the denominator.

    Args:
        logits: ``[..., num_keys]`` float32; masked keys are ``-inf``.
        sinks: ``None`` (a plain softmax) or float32 broadcastable to ``logits.shape[:-1] +
            (1,)`` (e.g. ``[1, group, 1, 1]`` for ``[n, group, q_len, keys]`` logits).

    Returns:
        ``[..., num_keys]`` float32 probabilities; each row sums to ``< 1`` with a sink.
    """
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    sink_col = sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Rescale an attention result to include the sink in its denominator.

    Args:
        out: ``[num_tokens, num_heads, head_size]`` float32, normalised over the real keys.
        lse: ``[num_tokens, num_heads]`` float32 natural-log LSE of those logits (``-inf``
            for a row that saw no key: its output becomes 0).
        sinks: ``[num_heads]`` float32 sink logits.

    Returns:
        ``out * sigmoid(lse - sinks)``, float32, same shape as ``out``.
    """
    return out * torch.sigmoid(lse - sinks.to(lse.device, torch.float32).view(1, -1)).unsqueeze(-1)
