"""M-RoPE positions (Qwen2-VL's multimodal rotary positions): ``[3, num_tokens]`` per step.

A Qwen2-VL-style model rotates each token by three positions — temporal, height, width
sections of the rotary dimensions. Text tokens have all three equal; the tokens of an
image placeholder span take ``start + (t, h, w)`` over the image's grid (row-major over
``t, h, w``), where ``start`` is the position the span begins at; the text after the span
continues at ``start + max(h, w)``. The convention is transformers' own
(``Qwen2VLModel.get_rope_index``, v5; tests/runner/step/test_mrope_positions_match_hf.py calls it): for
an image (``t = 1``) that is one more than the span's largest position.

The compiler computes each request's prompt positions once, at admission
(:func:`mrope_prompt_positions`: ``[3, num_prompt_tokens]`` plus the position delta
``max + 1 - num_prompt_tokens``), keeps them per request (:class:`MRopeStore`; never a
``[max_num_reqs, max_model_len]`` table), and each step gathers the scheduled tokens'
columns: prompt position ``p`` → column ``p``; a later (output) position ``p`` →
``p + delta`` in all three sections (vLLM's ``mrope_position_delta``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from attnplug.runner.step.check.types import err, is_int, show


@dataclass(frozen=True)
class PlaceholderRange:
    """One image's placeholder span in a prompt (hand-off data).

    Attributes:
        offset: first prompt position of the span (tokens).
        grid_thw: ``(t, h, w)``, the image's grid as the language model sees it — after
            the vision tower's spatial merge (transformers' ``image_grid_thw // (1, m, m)``
            for ``spatial_merge_size = m``); the span holds ``t * h * w`` tokens.
    """

    offset: int
    grid_thw: tuple[int, int, int]

    @property
    def length(self) -> int:
        """Tokens in the span, ``t * h * w``."""
        t, h, w = self.grid_thw
        return t * h * w


def check_placeholders(uses_mrope: bool, new_reqs: Sequence) -> dict[str, tuple]:
    """Stage 1: the new requests' ``mm_placeholders`` (each read once, from the snapshot).

    Returns:
        ``{req_id: (tuple of PlaceholderRange, num_prompt_tokens)}`` of the requests that
        carry any.

    Raises:
        InvalidSchedulerOutput: (field ``mm_placeholders``) placeholders given to a compiler
            built without ``uses_mrope``, not a list of :class:`PlaceholderRange`, a grid
            that is not three ints ``>= 1``, a span outside the prompt, or spans that
            overlap or are out of order.
    """
    out: dict[str, tuple] = {}
    for nr in new_reqs:
        ph = nr.mm_placeholders
        if ph is None or (isinstance(ph, (list, tuple)) and not ph):
            continue
        rid = nr.req_id
        if not uses_mrope:
            err(rid, "mm_placeholders", "this step compiler computes no M-RoPE positions (uses_mrope=False)")
        if not isinstance(ph, (list, tuple)) or not all(isinstance(p, PlaceholderRange) for p in ph):
            err(rid, "mm_placeholders", f"expected a list of PlaceholderRange, got {show(ph)}")
        L, end = len(nr.prompt_token_ids), 0
        for i, p in enumerate(ph):
            g = p.grid_thw
            if not isinstance(g, tuple) or len(g) != 3 or not all(is_int(x) and x >= 1 for x in g):
                err(rid, "mm_placeholders", f"item {i}: grid_thw must be three ints >= 1, got {show(g)}")
            if not is_int(p.offset) or p.offset < end or p.offset + p.length > L:
                err(rid, "mm_placeholders", f"item {i}: span [{show(p.offset)}, +{p.length}) must lie inside the "
                    f"prompt [0, {L}) after the previous span (ending at {end})")
            end = p.offset + p.length
        out[rid] = (tuple(ph), L)
    return out


def mrope_prompt_positions(num_prompt_tokens: int, placeholders: Sequence[PlaceholderRange]
                           ) -> tuple[np.ndarray, int]:
    """A prompt's M-RoPE positions and its position delta.

    Args:
        num_prompt_tokens: ``L``.
        placeholders: the image spans, in order, inside ``[0, L)``.

    Returns:
        ``(positions [3, L] int64, delta)``: rows temporal, height, width; ``delta`` is
        ``positions.max() + 1 - L`` (0 without images), added to every later position.
    """
    pos = np.empty((3, num_prompt_tokens), dtype=np.int64)
    cur = src = 0  # next position to give; next prompt index
    for p in placeholders:
        n = p.offset - src
        pos[:, src:p.offset] = np.arange(cur, cur + n)
        cur += n
        t, h, w = (int(x) for x in p.grid_thw)
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[:, p.offset:p.offset + p.length] = np.stack((tt.ravel(), hh.ravel(), ww.ravel())) + cur
        cur += max(h, w)
        src = p.offset + p.length
    pos[:, src:] = np.arange(cur, cur + num_prompt_tokens - src)
    delta = int(pos.max()) + 1 - num_prompt_tokens if num_prompt_tokens else 0
    return pos, delta


class MRopeStore:
    """Per resident request with images, its prompt positions; the step's output buffer.

    Args:
        max_num_batched_tokens: columns of the buffer.
        device: where :attr:`mrope_positions` lives.

    Attributes:
        prompts: ``{req_id: ([3, L] int64, delta)}``.
        mrope_positions: ``[3, max_num_batched_tokens]`` ``int64`` (host; copied to
            ``device`` per step).
    """

    def __init__(self, max_num_batched_tokens: int, device: torch.device):
        self.device = device
        self.prompts: dict[str, tuple[np.ndarray, int]] = {}
        self.host = np.zeros((3, max_num_batched_tokens), dtype=np.int64)
        self.mrope_positions = torch.zeros((3, max_num_batched_tokens), dtype=torch.int64, device=device)

    def update(self, finished: Sequence[str], new: dict[str, tuple]) -> None:
        """Stage 2: forget finished requests, then compute the new ones' prompt positions
        (``new``: :func:`check_placeholders`' result)."""
        if self.prompts:
            for rid in finished:
                self.prompts.pop(rid, None)
        for rid, (ph, L) in new.items():
            self.prompts[rid] = mrope_prompt_positions(L, ph)

    def fill(self, req_id_to_index: dict[str, int], R: int, P: int, positions_cpu: np.ndarray,
             query_start_loc_cpu: np.ndarray, num_computed_tokens: np.ndarray,
             num_scheduled_tokens: np.ndarray) -> torch.Tensor:
        """Stage 3: the step's ``[3, P]`` positions: ``positions`` in all three rows, then
        the rows of requests with images overwritten (prompt columns gathered, later
        positions shifted by the delta)."""
        host = self.host
        host[:, :P] = positions_cpu[:P]
        for rid, (table, delta) in self.prompts.items():
            r = req_id_to_index.get(rid)
            if r is None or r >= R:
                continue
            s, c, n = int(query_start_loc_cpu[r]), int(num_computed_tokens[r]), int(num_scheduled_tokens[r])
            L = table.shape[1]
            k = max(0, min(c + n, L) - c)  # scheduled prompt tokens
            if k:
                host[:, s:s + k] = table[:, c:c + k]
            if k < n:
                host[:, s + k:s + n] += delta
        out = self.mrope_positions[:, :P]
        out.copy_(torch.from_numpy(host[:, :P]), non_blocking=False)
        return out
