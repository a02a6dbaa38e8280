"""Stage 7 of a step with drafts: logits at every verification position, then verification.

``ModelRunner`` calls :func:`verify_step` instead of the plain sampler when
``StepInputs.spec_decode_metadata`` is set (``runner/step/spec_metadata.py``): the model's
logits are computed at ``metadata.logits_indices`` (``1 + d`` per kept row) and the
``RejectionSampler`` emits each row's accepted drafts plus one corrected or bonus token.
Rows without drafts sample exactly as ``Sampler`` would (the rejection sampler's ``d = 0``
case draws the same noise from the same generator).
"""

from __future__ import annotations

import numpy as np
import torch

from attnplug.runner.execute.spec_decode.rejection_sampler import RejectionSampler
from attnplug.runner.step.prepare import StepInputs


def verify_step(model, sampler: RejectionSampler, requests: dict, inputs: StepInputs, hidden: torch.Tensor,
                req_ids: list[str], keep: np.ndarray) -> tuple[list[list[int]], torch.Tensor]:
    """Verify one step's drafts.

    Args:
        model: has ``compute_logits(hidden [N, H]) -> [N, V]``.
        sampler: the runner's rejection sampler.
        requests: ``{req_id: CachedRequestState}`` (sampling params, generators).
        inputs: the step's inputs, ``spec_decode_metadata`` set (over the ``keep`` rows).
        hidden: ``[P, H]`` the model's last hidden states.
        req_ids, keep: the step's request ids in row order, the kept rows (ascending).

    Returns:
        ``(tokens, logits)``: per kept row its emitted token ids (``1 .. 1 + d``), and the
        ``[D + len(keep), V]`` logits at the verification positions.
    """
    spec = inputs.spec_decode_metadata
    idx = spec.logits_indices.to(hidden.device)
    logits = model.compute_logits(hidden.index_select(0, idx))
    states = [requests[req_ids[r]] for r in keep.tolist()]
    out = sampler(spec, logits, [st.sampling_params for st in states], [st.generator for st in states])
    return out.to_lists(), logits


def verified_logits(req_ids: list[str], keep: np.ndarray, tokens: list[list[int]], logits: torch.Tensor,
                    num_draft_tokens: list[int]) -> dict[str, torch.Tensor]:
    """``{req_id: [len(tokens), V] float32 CPU}``: the logits each emitted token was chosen
    from, for ``record_logits`` (kept row ``i`` owns ``1 + d_i`` consecutive rows of
    ``logits``, its ``j``-th emitted token comes from the ``j``-th of them)."""
    per_row = np.asarray(num_draft_tokens, dtype=np.int64) + 1
    starts = (np.cumsum(per_row) - per_row).tolist()
    lg = logits.float().cpu()
    return {req_ids[r]: lg[s:s + len(t)] for r, s, t in zip(keep.tolist(), starts, tokens)}
