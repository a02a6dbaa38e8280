"""Prompt embeddings through the step: check them (stage 1), keep them per request, and
write the scheduled slices into one preallocated ``inputs_embeds`` buffer (stage 3).

A request may give its prompt as embeddings (``NewRequestData.prompt_embeds``,
``[num_prompt_tokens, hidden_size]``; vLLM's ``--enable-prompt-embeds``). The compiler
keeps one tensor per such request (:class:`PromptEmbedsStore`; never a
``[max_num_reqs, max_model_len, hidden_size]`` table) from admission until the request
finishes, so a recompute after preemption or a chunked prefill reads the same rows again.
A step that schedules prompt positions of such requests gets
``StepInputs.inputs_embeds`` (``[P, hidden_size]``) and ``StepInputs.is_embed``
(``[P]`` bool): row ``t`` of the flat stream comes from the embeddings iff
``is_embed[t]``; the model embeds ``input_ids`` for the others (outputs, text requests,
padding). A step without such rows leaves both ``None``: text-only steps keep passing
``input_ids`` alone, and cost one emptiness test of the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from attnplug.runner.step.check.types import err, show


@dataclass(frozen=True)
class PromptEmbedsConfig:
    """What prompt embeddings a step compiler takes.

    Attributes:
        hidden_size: the model's hidden size (the embeddings' width).
        dtype: the model dtype; embeddings of another dtype are refused (no silent cast).
    """

    hidden_size: int
    dtype: torch.dtype


def check_prompt_embeds(cfg: PromptEmbedsConfig | None, new_reqs: Sequence) -> dict[str, torch.Tensor]:
    """Stage 1: the new requests' ``prompt_embeds`` (each read once, from the snapshot).

    Args:
        cfg: the compiler's config, ``None`` when it takes no embeddings.
        new_reqs: the snapshot's new requests (``check.snapshot.NewReq``), prompts already
            checked.

    Returns:
        ``{req_id: the caller's tensor}`` of the requests that carry embeddings (stage 2
        copies them).

    Raises:
        InvalidSchedulerOutput: (field ``prompt_embeds``) embeddings given to a compiler
            without a config, not a tensor, not 2-D ``[num_prompt_tokens, hidden_size]``,
            of another dtype, or holding a NaN or infinity.
    """
    out: dict[str, torch.Tensor] = {}
    for nr in new_reqs:
        e = nr.prompt_embeds
        if e is None:
            continue
        rid = nr.req_id
        if cfg is None:
            err(rid, "prompt_embeds", "this step compiler takes no prompt embeddings (build it with "
                "prompt_embeds=PromptEmbedsConfig(hidden_size, dtype); ModelRunner: enable_prompt_embeds=True)")
        if not isinstance(e, torch.Tensor):
            err(rid, "prompt_embeds", f"expected a torch.Tensor [num_prompt_tokens, hidden_size], got {show(e)}")
        want = (len(nr.prompt_token_ids), cfg.hidden_size)
        if tuple(e.shape) != want:
            err(rid, "prompt_embeds", f"shape {tuple(e.shape)} does not match [num_prompt_tokens, hidden_size] "
                f"= {list(want)}")
        if e.dtype != cfg.dtype:
            err(rid, "prompt_embeds", f"dtype {e.dtype} is not the model dtype {cfg.dtype}")
        if not bool(torch.isfinite(e).all()):
            err(rid, "prompt_embeds", "holds a NaN or an infinity")
        out[rid] = e
    return out


class PromptEmbedsStore:
    """The embeddings of resident requests and the step's ``inputs_embeds`` buffers.

    Args:
        cfg: width and dtype.
        max_num_batched_tokens: rows of the buffers (tokens in one step, at most).
        device: where the kept embeddings and the buffers live.

    Attributes:
        embeds: ``{req_id: [num_prompt_tokens, hidden_size]}`` (copies, on ``device``).
        inputs_embeds: ``[max_num_batched_tokens, hidden_size]`` ``cfg.dtype``, persistent.
        is_embed: ``[max_num_batched_tokens]`` ``bool``, persistent.
    """

    def __init__(self, cfg: PromptEmbedsConfig, max_num_batched_tokens: int, device: torch.device):
        self.cfg, self.device = cfg, device
        self.embeds: dict[str, torch.Tensor] = {}
        self.inputs_embeds = torch.zeros(max_num_batched_tokens, cfg.hidden_size, dtype=cfg.dtype, device=device)
        self.is_embed = torch.zeros(max_num_batched_tokens, dtype=torch.bool, device=device)

    def update(self, finished: Sequence[str], new: dict[str, torch.Tensor]) -> None:
        """Stage 2: forget finished requests, then keep copies of the new ones' embeddings
        (a request finished and re-sent in one step takes its new tensor)."""
        if self.embeds:
            for rid in finished:
                self.embeds.pop(rid, None)
        for rid, e in new.items():
            self.embeds[rid] = e.detach().to(self.device, copy=True)

    def fill(self, req_id_to_index: dict[str, int], R: int, P: int, query_start_loc_cpu: np.ndarray,
             num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Stage 3: write the scheduled prompt slices of this step's rows.

        Row ``r`` (``c = num_computed_tokens[r]``, ``n = num_scheduled_tokens[r]``) covers
        positions ``[c, c + n)``; those below its prompt length ``L`` take embeddings rows
        ``[c, min(c + n, L))`` at flat tokens ``query_start_loc[r] + [0, min(n, L - c))``.

        Returns:
            ``(inputs_embeds[:P], is_embed[:P])`` views, or ``None`` when no row of the step
            has embeddings for its scheduled positions.
        """
        if not self.embeds:
            return None
        spans = []
        for rid, e in self.embeds.items():
            r = req_id_to_index.get(rid)
            if r is None or r >= R:
                continue
            c, L = int(num_computed_tokens[r]), e.shape[0]
            if c < L:
                k = min(int(num_scheduled_tokens[r]), L - c)
                spans.append((int(query_start_loc_cpu[r]), e[c:c + k]))
        if not spans:
            return None
        buf, mask = self.inputs_embeds, self.is_embed
        mask[:P].zero_()
        for start, rows in spans:
            buf[start:start + rows.shape[0]].copy_(rows, non_blocking=True)
            mask[start:start + rows.shape[0]] = True
        return buf[:P], mask[:P]
