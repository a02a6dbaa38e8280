"""Sampling: greedy, and seeded temperature / top-k / top-p.

A request's draw depends only on its own logits and its own ``torch.Generator`` (seeded
from ``SamplingParams.seed``), never on which other requests share the batch — the
property the batch-invariance check of ``attnplug run`` relies on.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from attnplug.cache_groups.buffers import upload
from attnplug.runner.step.scheduler_output import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k / nucleus to ``-inf`` (vectorized over rows).

    Args:
        logits: ``[num_rows, vocab_size]``, float.
        top_k: ``[num_rows]`` int64; ``<= 0`` disables top-k for the row.
        top_p: ``[num_rows]`` float; ``>= 1`` disables top-p. The smallest set of tokens whose
            probability mass reaches ``top_p`` is kept (at least one token).

    Returns:
        A new tensor of the same shape and dtype.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    drop = ranks >= k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.float().masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p >= 1 keeps everything: the cumulative sum may round past 1 before the tail
    p = top_p.to(probs.dtype).unsqueeze(1)
    drop |= (mass_before >= p) & (p < 1)
    drop[:, 0].fill_(False)  # (``drop[:, 0] = False`` would copy a host scalar: a CUDA sync)
    masked_sorted = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked_sorted)


class Sampler:
    """Turns the logits of the rows that produce tokens into next-token ids."""

    def __init__(self, default_seed: int = 0):
        self._default_generator = torch.Generator().manual_seed(default_seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: ``[num_rows, vocab_size]``, float32, CPU or CUDA.
            params: one ``SamplingParams`` per row.
            generators: one ``torch.Generator`` per row (a seeded request), or ``None`` (draws
                come from the sampler's own generator).

        Returns:
            ``[num_rows]`` int64 token ids, on ``logits``' device.

        Never reads a device value on the host (greedy is decided from ``params``); seeded
        rows draw their noise on the CPU and copy it to the device.
        """
        n = logits.shape[0]
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        # max(dim).indices, not argmax: the same index (the first maximum; a NaN counts as the
        # maximum, the first NaN wins) and ~3x faster on the CPU (docs/performance.md,
        # "The forward's small ops, session 13"); tests/runner/execute pin the equality.
        greedy = logits.max(dim=-1).indices
        if all(p.temperature <= 0 for p in params):  # decided on the host: no device sync
            return greedy
        dev = logits.device  # per-row parameters through pinned copies: no host sync (cache_groups/buffers.upload)
        temps = upload(np.array([p.temperature for p in params], dtype=np.float32), dev)
        top_k = upload(np.array([p.top_k for p in params], dtype=np.int64), dev)
        top_p = upload(np.array([p.top_p for p in params], dtype=np.float32), dev)
        scaled = logits.float() / torch.where(temps > 0, temps, torch.ones_like(temps)).unsqueeze(1)
        probs = torch.softmax(apply_top_k_top_p(scaled, top_k, top_p), dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; each row's E comes
        # from its own generator, so its draw does not depend on the other rows.
        noise = torch.empty_like(probs)
        shared_rows = [i for i, g in enumerate(generators) if g is None]
        if shared_rows:
            draw = torch.empty((len(shared_rows), probs.shape[1]), device="cpu")
            draw.exponential_(generator=self._default_generator)
            rows = upload(np.array(shared_rows, dtype=np.int64), probs.device)
            noise.index_copy_(0, rows, upload(draw, probs.device))
        for i, g in enumerate(generators):
            if g is not None:
                noise[i] = upload(torch.empty(probs.shape[1], device="cpu").exponential_(generator=g), probs.device)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temps > 0, sampled, greedy)
