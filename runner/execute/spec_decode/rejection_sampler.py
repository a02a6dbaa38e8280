"""Verification of draft tokens against the target model: the rejection sampler.

Per request with drafts ``x_0 .. x_{d-1}``, target distributions ``p_0 .. p_d`` (the target's
logits at its ``1 + d`` verification positions, after temperature / top-k / top-p) and draft
distributions ``q_0 .. q_{d-1}``:

* **greedy** (``temperature <= 0``): accept ``x_j`` while ``x_j == argmax(logits_j)``; at the
  first mismatch emit ``argmax(logits_j)`` and stop; if all ``d`` are accepted emit the bonus
  ``argmax(logits_d)``. The output is exactly what ``d + 1`` sequential greedy steps give.
* **random**: the speculative-sampling rule of Leviathan et al. 2023 ("Fast Inference from
  Transformers via Speculative Decoding") and Chen et al. 2023 ("Accelerating Large Language
  Model Decoding with Speculative Sampling"): accept ``x_j`` with probability
  ``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection emit a token drawn from
  ``normalise(max(0, p_j - q_j))`` and stop; if all are accepted emit a bonus token drawn from
  ``p_d``. Each emitted token is then distributed exactly as ``p`` (the test checks this
  empirically). Drafts without a distribution (``draft_probs=None``, the n-gram drafter) count
  as ``q_j = one_hot(x_j)``: accept with probability ``p_j(x_j)``, else draw from ``p_j`` with
  ``x_j`` removed.

Randomness: a request with a ``torch.Generator`` draws, on the CPU and in this order,
``d`` uniforms (the accept tests) then a ``[d + 1, V]`` block of Exp(1) noise (one
exponential race ``argmax(w / E)`` per position, which draws from ``normalise(w)``), whatever
it accepts and whatever else is in the batch, so its tokens do not depend on the batch.
With ``d = 0`` that is the ``[V]`` noise ``Sampler`` draws, so a row without drafts samples
the same token as ``Sampler`` would. Requests without a generator share the sampler's own.
Greedy rows draw nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from attnplug.core.errors import MetadataError
from attnplug.runner.execute.sampler import apply_top_k_top_p
from attnplug.runner.step.spec_metadata import SpecDecodeMetadata
from attnplug.runner.step.scheduler_output import SamplingParams

PLACEHOLDER_TOKEN_ID = -1
"""Fills ``RejectionOutput.token_ids`` past each request's emitted tokens."""


@dataclass
class RejectionOutput:
    """What one verification step emits.

    Attributes:
        token_ids: ``[R, max_spec_len + 1]`` int64 on the logits' device; row ``i`` holds
            ``num_accepted[i]`` accepted drafts, then one corrected (or bonus) token, then
            ``PLACEHOLDER_TOKEN_ID``.
        num_accepted: ``[R]`` int64, accepted drafts per request (``0 .. d_i``); request ``i``
            emits ``num_accepted[i] + 1`` tokens.
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor

    def to_lists(self) -> list[list[int]]:
        """Per request, its emitted token ids (reads the device: one sync)."""
        counts = (self.num_accepted + 1).tolist()
        rows = self.token_ids.tolist()
        return [row[:n] for row, n in zip(rows, counts)]


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``softmax(top_k_top_p(logits / temperature))`` per row, float32.

    Args:
        logits: ``[N, V]`` float.
        params: one ``SamplingParams`` per row (``temperature <= 0`` rows are scaled by 1).

    Returns:
        ``[N, V]`` float32 probabilities on ``logits``' device.
    """
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    scaled = logits.float() / torch.where(temps > 0, temps, torch.ones_like(temps)).unsqueeze(1)
    return torch.softmax(apply_top_k_top_p(scaled, top_k, top_p), dim=-1)


class RejectionSampler:
    """Verifies a step's drafts and emits each request's accepted tokens.

    Args:
        default_seed: seeds the generator shared by requests without their own.
    """

    def __init__(self, default_seed: int = 0):
        self._default_generator = torch.Generator().manual_seed(default_seed)

    def __call__(self, metadata: SpecDecodeMetadata, logits: torch.Tensor,
                 params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                 draft_probs: torch.Tensor | None = None) -> RejectionOutput:
        """Verify.

        Args:
            metadata: the step's ``SpecDecodeMetadata`` (``R`` requests, ``D`` drafts).
            logits: ``[D + R, V]`` float, the target's logits at ``metadata.logits_indices``
                (row order of ``logits_indices``).
            params: ``R`` ``SamplingParams``; ``temperature <= 0`` is greedy.
            generators: ``R`` entries, a request's own generator or ``None``.
            draft_probs: ``[D, V]`` float, ``q`` of each draft (already under the request's
                temperature / top-k / top-p, as the draft model sampled it), or ``None`` for
                deterministic drafts (one-hot ``q``).

        Returns:
            ``RejectionOutput``.

        Raises:
            MetadataError: a shape disagrees with ``metadata``, or a draft id is outside
                ``0 .. V-1`` (checked for CPU tensors only: on a GPU the check would sync).
        """
        counts = metadata.num_draft_tokens
        R, D = len(counts), sum(counts)
        if logits.dim() != 2 or logits.shape[0] != D + R:
            raise MetadataError(f"logits must be [{D + R}, V] (drafts + requests), got {tuple(logits.shape)}")
        if len(params) != R or len(generators) != R:
            raise MetadataError(f"need {R} params and generators, got {len(params)} and {len(generators)}")
        V, dev = logits.shape[1], logits.device
        drafts = metadata.draft_token_ids.to(device=dev, dtype=torch.int64)
        if drafts.shape != (D,):
            raise MetadataError(f"draft_token_ids must be [{D}], got {tuple(drafts.shape)}")
        if draft_probs is not None and tuple(draft_probs.shape) != (D, V):
            raise MetadataError(f"draft_probs must be [{D}, {V}], got {tuple(draft_probs.shape)}")
        if drafts.device.type == "cpu" and D and not bool(((drafts >= 0) & (drafts < V)).all()):
            raise MetadataError(f"a draft token id is outside the vocabulary 0..{V - 1}")
        max_d = max(counts, default=0)
        if R == 0:
            empty = torch.empty((0, 1), dtype=torch.int64, device=dev)
            return RejectionOutput(empty, torch.empty(0, dtype=torch.int64, device=dev))

        target_logits = logits[metadata.target_logits_indices.to(dev)]          # [D, V]
        bonus_logits = logits[metadata.bonus_logits_indices.to(dev)]            # [R, V]
        # Greedy decisions for every row (cheap; random rows overwrite theirs below).
        recovered = target_logits.argmax(dim=-1)                                # [D]
        accept = drafts == recovered                                            # [D]
        bonus = bonus_logits.argmax(dim=-1)                                     # [R]

        random_rows = [i for i, p in enumerate(params) if p.temperature > 0]    # host: no sync
        if random_rows:
            accept, recovered, bonus = self._random(
                metadata, target_logits, bonus_logits, drafts, draft_probs, params, generators,
                random_rows, accept, recovered, bonus)

        # Lay drafts out as [R, max_d] (host-built index; padding is never accepted).
        starts = np.cumsum(counts) - np.asarray(counts, dtype=np.int64)
        cols = np.arange(max_d)
        valid_np = cols[None, :] < np.asarray(counts)[:, None]
        flat_np = np.where(valid_np, starts[:, None] + cols[None, :], 0)
        flat = torch.from_numpy(flat_np.astype(np.int64)).to(dev)
        valid = torch.from_numpy(valid_np).to(dev)
        acc_pad = accept[flat] & valid if D else torch.zeros((R, max_d), dtype=torch.bool, device=dev)
        num_accepted = acc_pad.to(torch.int64).cumprod(dim=1).sum(dim=1)        # [R]

        out = torch.full((R, max_d + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=dev)
        if D:
            out[:, :max_d] = torch.where(
                torch.arange(max_d, device=dev)[None, :] < num_accepted[:, None], drafts[flat],
                torch.full_like(flat, PLACEHOLDER_TOKEN_ID))
        counts_t = torch.tensor(counts, dtype=torch.int64, device=dev)
        all_accepted = num_accepted == counts_t
        if D:
            rejected_pos = flat.gather(1, num_accepted.clamp(max=max(max_d - 1, 0)).unsqueeze(1)).squeeze(1)
            final = torch.where(all_accepted, bonus, recovered[rejected_pos])
        else:
            final = bonus
        out.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
        return RejectionOutput(out, num_accepted)

    def _random(self, metadata, target_logits, bonus_logits, drafts, draft_probs, params,
                generators, random_rows, accept, recovered, bonus):
        """The accept/reject rule for the rows with ``temperature > 0`` (see the module doc)."""
        counts = metadata.num_draft_tokens
        dev, V = target_logits.device, target_logits.shape[1]
        starts = np.cumsum(counts) - np.asarray(counts, dtype=np.int64)
        draft_rows = np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in random_rows])
        draft_rows_t = torch.from_numpy(draft_rows.astype(np.int64)).to(dev)
        row_params = [params[i] for i in random_rows]
        draft_params = [params[i] for i in random_rows for _ in range(counts[i])]

        # The draws, request by request in a fixed order (module doc).
        u_parts, e_draft_parts, e_bonus_parts = [], [], []
        for i in random_rows:
            g = generators[i] if generators[i] is not None else self._default_generator
            d = counts[i]
            u_parts.append(torch.rand(d, generator=g))
            e = torch.empty((d + 1, V)).exponential_(generator=g)
            e_draft_parts.append(e[:d])
            e_bonus_parts.append(e[d:])
        e_bonus = torch.cat(e_bonus_parts).to(dev)

        p_bonus = target_probs(bonus_logits[random_rows], row_params)
        rows_t = torch.tensor(random_rows, dtype=torch.int64, device=dev)
        bonus = bonus.clone()
        bonus[rows_t] = (p_bonus / e_bonus).argmax(dim=-1)
        if draft_rows.size == 0:
            return accept, recovered, bonus

        u = torch.cat(u_parts).to(dev)
        e_draft = torch.cat(e_draft_parts).to(dev)
        x = drafts[draft_rows_t]
        p = target_probs(target_logits[draft_rows_t], draft_params)             # [Dr, V]
        p_x = p.gather(1, x.unsqueeze(1)).squeeze(1)
        if draft_probs is None:
            q = torch.zeros_like(p).scatter_(1, x.unsqueeze(1), 1.0)
            q_x = torch.ones_like(p_x)
        else:
            q = draft_probs[draft_rows_t].to(dev, torch.float32)
            q_x = q.gather(1, x.unsqueeze(1)).squeeze(1)
        # P(u * q_x < p_x) = min(1, p_x / q_x) for u ~ U[0, 1).
        acc = u * q_x < p_x
        residual = (p - q).clamp(min=0)
        # p == q (up to rounding) leaves nothing: rejection then has probability 0 anyway.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
        rec = (residual / e_draft).argmax(dim=-1)
        accept, recovered = accept.clone(), recovered.clone()
        accept[draft_rows_t] = acc
        recovered[draft_rows_t] = rec
        return accept, recovered, bonus
