"""``attnplug parity`` on a multimodal config (Qwen2-VL): random images through our engine
against HF ``Qwen2VLForConditionalGeneration`` on the same random weights.

Each request's prompt is text, then its images (1 or 2, alternating by request: ``vision_start``,
the image's placeholder tokens, ``vision_end``, more text), then text; every image has random
pixel values and a random patch grid ``(1, a*m, b*m)`` (``m`` the merge size, ``a, b`` in 1..3).
With ``--prefix-caching`` the requests come in groups of three with the same token ids: the
second repeats the first's images (its blocks hit), the third has new ones (no block at or
after its first image hits). The reference decodes greedily one request at a time with a full
recompute each token (``attn_implementation="eager"``, ``mm_token_type_ids`` from the image
token, as transformers' processor gives them); ours runs continuous batching, chunked prefill
that cuts image spans, optional forced preemption and prefix caching.
"""

from __future__ import annotations

import numpy as np
import torch

from attnplug.core.errors import AttnplugError
from attnplug.runner.commands.parity_compare import ParityResult, compare_with_reference
from attnplug.runner.step.multimodal import image_feature


def _hf_model(cfg_dict: dict, seed: int, dtype: torch.dtype):
    import transformers

    cfg = transformers.AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(seed)
    hf = transformers.Qwen2VLForConditionalGeneration._from_config(cfg, attn_implementation="eager", dtype=dtype)
    return cfg, hf.eval()


@torch.inference_mode()
def _hf_greedy(hf, image_token_id: int, prompt: list[int], feats, num_tokens: int):
    ids = torch.tensor([prompt], dtype=torch.long)
    pixels = torch.cat([f.pixel_values for f in feats]).to(hf.dtype)
    grid = torch.tensor([list(f.image_grid_thw) for f in feats])
    out, logits = [], []
    for _ in range(num_tokens):
        step = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, use_cache=False,
                  mm_token_type_ids=(ids == image_token_id).int()).logits[0, -1].float()
        out.append(int(step.argmax()))
        logits.append(step)
        ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out, logits


def make_mm_requests(cfg, num_requests: int, seed: int, prefix_caching: bool):
    """``({req_id: prompt}, {req_id: [MultiModalFeature]})`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    v, m = cfg.vision_config, cfg.vision_config.spatial_merge_size
    special = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}
    vocab = [t for t in range(cfg.text_config.vocab_size) if t not in special]
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2

    def text(n):
        return [int(t) for t in rng.choice(vocab, size=n)]

    def images(layout):
        return [(1, a * m, b * m) for a, b in layout], [torch.randn(a * b * m * m, patch_dim, dtype=torch.float32,
                                                                      generator=gen) for a, b in layout]

    gen = torch.Generator().manual_seed(seed)
    prompts, features = {}, {}
    i = 0
    while len(prompts) < num_requests:
        n_img = 1 + i % 2
        layout = [(int(rng.integers(1, 4)), int(rng.integers(1, 4))) for _ in range(n_img)]
        pieces = [text(int(rng.integers(2, 8)))] + [text(int(rng.integers(1, 5))) for _ in range(n_img)]
        variants = [None, "same", "new"] if prefix_caching else [None]
        grids, pixels = images(layout)
        for kind in variants[:num_requests - len(prompts)]:
            if kind == "new":
                grids, pixels = images(layout)
            prompt, feats = list(pieces[0]), []
            for g, px, tail in zip(grids, pixels, pieces[1:]):
                prompt.append(cfg.vision_start_token_id)
                feats.append(image_feature(px, g, len(prompt), m))
                prompt += [cfg.image_token_id] * feats[-1].num_embeds + [cfg.vision_end_token_id] + tail
            rid = f"req-{len(prompts)}"
            prompts[rid], features[rid] = prompt, feats
        i += 1
    return prompts, features


def run_mm_parity(cfg_dict: dict, *, num_requests: int, seed: int, force_preemption: bool, tdtype: torch.dtype,
                  max_num_batched_tokens: int, max_tokens: int, block_size: int, backend: str | None,
                  async_scheduling: bool, prefix_caching: bool, **unused) -> ParityResult:
    """The comparison (module docstring); ``unused``: options a multimodal run refuses when set.

    Raises:
        AttnplugError: ``--speculative`` or an fp8 KV cache (not supported with images).
    """
    from attnplug.runner.commands.assemble import resolve_backend
    from attnplug.runner.commands.model_loading import build_with_backends

    if unused.get("speculative") or unused.get("kv_cache_dtype", "auto") != "auto":
        raise AttnplugError("parity on a multimodal config supports neither --speculative nor an fp8 KV cache")
    cfg, hf = _hf_model(cfg_dict, seed, tdtype)
    model = build_with_backends(cfg.to_dict(), backend=backend, block_size=block_size, resolve=resolve_backend,
                                dtype=tdtype)
    model.load_hf_state_dict(hf.state_dict())
    prompts, features = make_mm_requests(cfg, num_requests, seed, prefix_caching)
    max_len = max(len(p) for p in prompts.values())
    return compare_with_reference(
        model, prompts, lambda rid, p: _hf_greedy(hf, cfg.image_token_id, p, features[rid], max_tokens), tdtype,
        backend=backend, block_size=block_size, seed=seed, max_model_len=max_len + max_tokens + block_size,
        max_num_batched_tokens=max_num_batched_tokens, max_tokens=max_tokens, force_preemption=force_preemption,
        async_scheduling=async_scheduling, prefix_caching=prefix_caching, mm_features=features)
