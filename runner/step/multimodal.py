"""Images through the step: check each request's multimodal features (stage 1), keep them per
request (stage 2), and say which slice of which image each scheduled placeholder token takes
(stage 3: :class:`MMSlice`; the runner's encoder cache fills them, ``runner/execute/encoder_cache.py``).

A new request's ``NewRequestData.mm_features`` lists its images in prompt order, each a
:class:`MultiModalFeature` (vLLM's ``MultiModalFeatureSpec``: encoder input, content hash
``mm_hash`` — the ``identifier`` — and the placeholder span ``mm_position``). The placeholder
tokens of an image are replaced by the vision tower's output rows: row ``j`` of the image's
encoder output is the embedding of prompt position ``mm_position.offset + j``. A chunked
prefill may cut a span: each step takes only the rows of its scheduled positions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

import numpy as np
import torch

from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.check.types import err, is_int, show
from attnplug.runner.step.mrope import PlaceholderRange, check_placeholders


@dataclass(frozen=True)
class MultiModalConfig:
    """What images a step compiler takes (the model's vision tower).

    Attributes:
        spatial_merge_size: ``m``: ``m x m`` patches become one placeholder token.
        patch_dim: pixel values per patch (``in_channels * temporal_patch_size * patch_size**2``).
    """

    spatial_merge_size: int
    patch_dim: int


@dataclass(frozen=True)
class MultiModalFeature:
    """One image of a prompt (hand-off data).

    Attributes:
        pixel_values: ``[t * H * W, patch_dim]`` float, the image's patches (the image
            processor's order: block-major over merge blocks).
        image_grid_thw: ``(t, H, W)``: the patch grid before the spatial merge (transformers'
            ``image_grid_thw`` row).
        mm_hash: the content hash (a non-empty str; :func:`image_feature` computes sha256 of
            the grid and pixel bytes); equal hashes mean equal encoder outputs (the encoder
            cache and prefix caching rely on it).
        mm_position: the placeholder span, grid ``(t, H / m, W / m)``.
    """

    pixel_values: torch.Tensor
    image_grid_thw: tuple[int, int, int]
    mm_hash: str
    mm_position: PlaceholderRange

    @property
    def num_embeds(self) -> int:
        """Placeholder tokens (encoder output rows) of the image."""
        return self.mm_position.length


def mm_content_hash(pixel_values: torch.Tensor, image_grid_thw: tuple[int, int, int]) -> str:
    """sha256 (hex) over the grid and the pixel values' dtype, shape and bytes."""
    h = hashlib.sha256(b"attnplug-mm-v1")
    h.update(repr((tuple(int(g) for g in image_grid_thw), str(pixel_values.dtype),
                   tuple(pixel_values.shape))).encode())
    h.update(pixel_values.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())  # any dtype
    return h.hexdigest()


def image_feature(pixel_values: torch.Tensor, image_grid_thw: tuple[int, int, int], offset: int,
                  spatial_merge_size: int) -> MultiModalFeature:
    """A :class:`MultiModalFeature` whose span starts at prompt position ``offset``, with its
    content hash and its placeholder grid ``(t, H // m, W // m)``."""
    t, h, w = (int(g) for g in image_grid_thw)
    m = spatial_merge_size
    return MultiModalFeature(pixel_values, (t, h, w), mm_content_hash(pixel_values, (t, h, w)),
                             PlaceholderRange(offset, (t, h // m, w // m)))


def check_mm_features(cfg: MultiModalConfig | None, new_reqs: Sequence) -> dict[str, tuple]:
    """Stage 1: the new requests' ``mm_features`` (each read once, from the snapshot).

    Returns:
        ``{req_id: (tuple of MultiModalFeature, num_prompt_tokens)}`` of the requests that
        carry any.

    Raises:
        InvalidSchedulerOutput: (field ``mm_features``) features given to a compiler built
            without a :class:`MultiModalConfig`, together with ``mm_placeholders``, not a list
            of :class:`MultiModalFeature`, a patch grid that is not three ints ``>= 1`` with
            ``H``, ``W`` multiples of the merge size, a grid that does not match the
            placeholder span's (``(t, H / m, W / m)``), pixel values that are not a finite
            float tensor ``[t * H * W, patch_dim]``, an empty hash; (``mm_placeholders``
            rules) a span outside the prompt, overlapping or out of order.
    """
    out: dict[str, tuple] = {}
    for nr in new_reqs:
        feats = nr.mm_features
        if feats is None or (isinstance(feats, (list, tuple)) and not feats):
            continue
        rid = nr.req_id
        if cfg is None:
            err(rid, "mm_features", "this step compiler takes no images (build it with "
                "multimodal=MultiModalConfig(...); ModelRunner: a model with embed_image)")
        if nr.mm_placeholders:
            err(rid, "mm_features", "give the image spans once: mm_features carry them (mm_position), "
                "so mm_placeholders must be None")
        if not isinstance(feats, (list, tuple)) or not all(isinstance(f, MultiModalFeature) for f in feats):
            err(rid, "mm_features", f"expected a list of MultiModalFeature, got {show(feats)}")
        for i, f in enumerate(feats):
            _check_feature(cfg, rid, i, f)
        probe = SimpleNamespace(req_id=rid, prompt_token_ids=nr.prompt_token_ids,
                                mm_placeholders=[f.mm_position for f in feats])
        try:
            check_placeholders(True, [probe])
        except InvalidSchedulerOutput as e:  # the span rules, worded for this field
            err(rid, "mm_features", f"mm_position {str(e).split('mm_placeholders: ', 1)[-1]}")
        out[rid] = (tuple(feats), len(nr.prompt_token_ids))
    return out


def _check_feature(cfg: MultiModalConfig, rid: str, i: int, f: MultiModalFeature) -> None:
    g, m = f.image_grid_thw, cfg.spatial_merge_size
    if not isinstance(g, tuple) or len(g) != 3 or not all(is_int(x) and x >= 1 for x in g) \
            or g[1] % m or g[2] % m:
        err(rid, "mm_features", f"item {i}: image_grid_thw must be three ints >= 1 with H and W multiples "
            f"of spatial_merge_size {m}, got {show(g)}")
    if not isinstance(f.mm_position, PlaceholderRange):
        err(rid, "mm_features", f"item {i}: mm_position must be a PlaceholderRange, got {show(f.mm_position)}")
    want = (g[0], g[1] // m, g[2] // m)
    if tuple(f.mm_position.grid_thw) != want:
        err(rid, "mm_features", f"item {i}: image grid {list(g)} gives {want[0] * want[1] * want[2]} placeholder "
            f"tokens {list(want)}, but its span has grid {show(f.mm_position.grid_thw)}")
    p = f.pixel_values
    shape = (g[0] * g[1] * g[2], cfg.patch_dim)
    if not isinstance(p, torch.Tensor) or not p.is_floating_point() or tuple(p.shape) != shape:
        err(rid, "mm_features", f"item {i}: pixel_values must be a float tensor of shape {list(shape)} "
            f"([t * H * W, patch_dim]), got {show(p) if not isinstance(p, torch.Tensor) else (p.dtype, tuple(p.shape))}")
    if not bool(torch.isfinite(p).all()):
        err(rid, "mm_features", f"item {i}: pixel_values hold a NaN or an infinity")
    if not isinstance(f.mm_hash, str) or not f.mm_hash:
        err(rid, "mm_features", f"item {i}: mm_hash must be a non-empty str, got {show(f.mm_hash)}")


@dataclass(frozen=True)
class MMSlice:
    """Rows of one image's encoder output that one step's flat tokens take (hand-off data).

    Attributes:
        req_id: the request; ``feature``: the image.
        dest: first flat token index of this step.
        start: first row of the image's encoder output.
        length: rows (tokens).
        completes: the step reaches the span's last token (the request needs the image no
            more unless it is recomputed after a preemption).
    """

    req_id: str
    feature: MultiModalFeature
    dest: int
    start: int
    length: int
    completes: bool


class MultiModalStore:
    """The images of resident requests, from admission until the request finishes.

    Attributes:
        features: ``{req_id: tuple of MultiModalFeature}``.
    """

    def __init__(self):
        self.features: dict[str, tuple[MultiModalFeature, ...]] = {}

    def update(self, finished: Sequence[str], new: dict[str, tuple]) -> None:
        """Stage 2: forget finished requests, keep the new ones' features."""
        if self.features:
            for rid in finished:
                self.features.pop(rid, None)
        for rid, (feats, _) in new.items():
            self.features[rid] = feats

    def slices(self, req_id_to_index: dict[str, int], R: int, query_start_loc_cpu: np.ndarray,
               num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray) -> list[MMSlice]:
        """Stage 3: for each row ``r`` (positions ``[c, c + n)``), the part of each image
        span inside that range, at flat tokens ``query_start_loc[r] + (position - c)``."""
        out: list[MMSlice] = []
        for rid, feats in self.features.items():
            r = req_id_to_index.get(rid)
            if r is None or r >= R:
                continue
            c, n, s = int(num_computed_tokens[r]), int(num_scheduled_tokens[r]), int(query_start_loc_cpu[r])
            for f in feats:
                off, length = f.mm_position.offset, f.mm_position.length
                lo, hi = max(c, off), min(c + n, off + length)
                if lo < hi:
                    out.append(MMSlice(rid, f, s + lo - c, lo - off, hi - lo, hi == off + length))
        return out
