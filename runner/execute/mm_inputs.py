"""A step's image rows: the encoder cache's outputs written into one preallocated
``inputs_embeds`` buffer (``runner/execute/encoder_cache.py`` keeps them; the step compiler's
``StepInputs.mm_slices`` say which rows go where, ``runner/step/multimodal.py``)."""

from __future__ import annotations

import torch

from attnplug.core.errors import MetadataError
from attnplug.runner.execute.encoder_cache import EncoderCache
from attnplug.runner.step.multimodal import MultiModalConfig


def multimodal_config(model: torch.nn.Module, graphs: bool) -> MultiModalConfig | None:
    """The model's image input (a model with ``embed_image`` and a ``config.vision``), else ``None``.

    Raises:
        ValueError: such a model with CUDA graphs (``graphs``): a captured forward replays
            ``input_ids`` and 1-D positions only.
    """
    vision = getattr(getattr(model, "config", None), "vision", None)
    if not hasattr(model, "embed_image") or vision is None:
        return None
    if graphs:
        raise ValueError(f"{type(model).__name__} (images, M-RoPE positions) needs cudagraph_mode none "
                         "(graphs replay input_ids and 1-D positions only)")
    return MultiModalConfig(vision.spatial_merge_size, vision.patch_dim)


class MultiModalInputs:
    """The runner's image path.

    Args:
        model: has ``embed_image(pixel_values, image_grid_thw) -> [num_embeds, hidden_size]``.
        max_num_batched_tokens: rows of the buffers.
        hidden_size, dtype, device: of the model's embeddings.
        budget_tokens: the encoder cache's budget (rows).

    Attributes:
        cache: the :class:`EncoderCache`.
        inputs_embeds: ``[max_num_batched_tokens, hidden_size]``, persistent.
        is_embed: ``[max_num_batched_tokens]`` ``bool``, persistent.
    """

    def __init__(self, model, max_num_batched_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, budget_tokens: int):
        self.model = model
        self.cache = EncoderCache(budget_tokens)
        self.inputs_embeds = torch.zeros(max_num_batched_tokens, hidden_size, dtype=dtype, device=device)
        self.is_embed = torch.zeros(max_num_batched_tokens, dtype=torch.bool, device=device)

    def applied(self, scheduler_output) -> None:
        """After ``update_states`` applied an output: finished requests, requests resumed
        after a preemption and requests re-sent whole drop their references."""
        for rid in scheduler_output.finished_req_ids:
            self.cache.release_request(rid)
        cached = scheduler_output.scheduled_cached_reqs
        for rid, resumed in zip(cached.req_ids, cached.resumed_from_preemption):
            if resumed:
                self.cache.release_request(rid)
        for nr in scheduler_output.scheduled_new_reqs:
            self.cache.release_request(nr.req_id)

    def embeds(self, inputs, n: int) -> dict:
        """``model.forward``'s ``inputs_embeds`` / ``is_embed`` for the step's first ``n`` tokens:
        prompt-embedding rows (if any), then each ``MMSlice``'s encoder rows; ``{}`` for a
        step with neither.

        Raises:
            MetadataError: an encoder output whose row count is not the image's placeholder count.
        """
        slices = inputs.mm_slices
        if not slices:
            if inputs.inputs_embeds is None:
                return {}
            return {"inputs_embeds": inputs.inputs_embeds[:n], "is_embed": inputs.is_embed[:n]}
        buf, mask = self.inputs_embeds[:n], self.is_embed[:n]
        if inputs.inputs_embeds is not None:
            buf.copy_(inputs.inputs_embeds[:n])
            mask.copy_(inputs.is_embed[:n])
        else:
            mask.zero_()
        for s in slices:
            f = s.feature
            rows = self.cache.rows(s.req_id, f.mm_hash, lambda: self.model.embed_image(f.pixel_values, f.image_grid_thw))
            if rows.shape[0] != f.num_embeds:
                raise MetadataError(f"embed_image of request {s.req_id!r}'s image {f.mm_hash[:12]} returned "
                                    f"{rows.shape[0]} rows for {f.num_embeds} placeholder tokens")
            buf[s.dest:s.dest + s.length] = rows[s.start:s.start + s.length]
            mask[s.dest:s.dest + s.length] = True
        return {"inputs_embeds": buf, "is_embed": mask}

    def done(self, inputs) -> None:
        """After the forward: a request whose chunk reached an image span's end releases it."""
        for s in inputs.mm_slices or ():
            if s.completes:
                self.cache.release(s.req_id, s.feature.mm_hash)
