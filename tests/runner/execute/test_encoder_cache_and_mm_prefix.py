"""Images through the engine (tiny random Qwen2-VL): chunked prefill cuts image spans and each
chunk takes its slice of the image's encoder output, encoded once and freed after the span
(the encoder cache's policy, runner/execute/encoder_cache.py); prefix caching hits the blocks of
a request repeating the same text and image, and misses from the first block of the image
span when the image differs (block hashes keyed by the content hash)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnplug.cache_groups.block_hash import mm_extra_keys
from attnplug.runner.commands.assemble import build_engine, resolve_backend
from attnplug.runner.commands.model_loading import build_with_backends
from attnplug.runner.execute.encoder_cache import EncoderCache
from attnplug.runner.step.multimodal import image_feature
from attnplug.runner.step.scheduler_output import SamplingParams

CFG = {"model_type": "qwen2_vl", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.1,
       "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1]},
       "vision_config": {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "spatial_merge_size": 2,
                         "patch_size": 2, "temporal_patch_size": 2, "in_channels": 3, "mlp_ratio": 2},
       "image_token_id": 90}
IMG, START, END, BLOCK = 90, 92, 93, 4


def engine(budget=8, prefix=False):
    model = build_with_backends(CFG, backend="torch_native", block_size=BLOCK, resolve=resolve_backend)
    args = SimpleNamespace(model=None, backend="torch_native", block_size=BLOCK, seed=0, max_model_len=96,
                           max_num_seqs=4, max_num_batched_tokens=budget, num_blocks=None,
                           force_preemption_every=None, record_logits=False, async_scheduling=False,
                           prefix_caching=prefix, speculative=None, kv_cache_dtype="auto", kv_scales="first_batch")
    return build_engine(args, model=model, requests=False).engine


def request(text_before, grid, seed, text_after=(5, 6, 7)):
    px = torch.randn(grid[0] * grid[1] * grid[2], 24, generator=torch.Generator().manual_seed(seed))
    prompt = list(text_before) + [START]
    feat = image_feature(px, grid, len(prompt), 2)
    return prompt + [IMG] * feat.num_embeds + [END] + list(text_after), [feat]


def test_chunks_cut_the_span_and_each_image_is_encoded_once_then_freed():
    eng = engine(budget=4)
    mm = eng.runner.mm_inputs
    seen, calls = [], []
    fill = mm.embeds

    def spy(inputs, n):
        seen.extend(inputs.mm_slices or ())
        return fill(inputs, n)

    encode, done, freed_after_span = eng.runner.model.embed_image, mm.done, []

    def spy_done(inputs):
        done(inputs)
        ends = [s.feature.mm_hash for s in inputs.mm_slices or () if s.completes]
        freed_after_span.extend(h not in mm.cache.entries for h in ends)  # freed by the step that passed it

    mm.embeds, mm.done, eng.runner.model.embed_image = spy, spy_done, lambda *a: calls.append(1) or encode(*a)
    prompts = {"a": request([3, 4], (1, 4, 6), 0), "b": request([8], (1, 2, 4), 1)}
    for rid, (p, feats) in prompts.items():
        eng.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=3), mm_features=feats)
    eng.run()
    assert any(s.start > 0 for s in seen), "no chunk began inside an image span"
    for rid, (_, (f,)) in prompts.items():  # the slices of each image tile its span exactly once
        rows = sorted((s.start, s.length) for s in seen if s.req_id == rid)
        assert sum(n for _, n in rows) == f.num_embeds and rows[0][0] == 0
    assert freed_after_span == [True, True]
    assert len(calls) == 2 and mm.cache.stats.computed == 2 and mm.cache.stats.hits == len(seen) - 2
    assert mm.cache.entries == {} and mm.cache.num_tokens == 0 and mm.cache.stats.freed == 2


def test_encoder_cache_budget_and_references():
    cache = EncoderCache(budget_tokens=6)
    rows = cache.rows("r1", "h1", lambda: torch.zeros(4, 2))
    assert cache.rows("r2", "h1", lambda: pytest.fail("recomputed")) is rows and cache.refs["h1"] == {"r1", "r2"}
    cache.rows("r1", "h2", lambda: torch.zeros(3, 2))  # 4 + 3 > 6: computed, not kept
    assert "h2" not in cache.entries and cache.stats.uncached == 1
    cache.release("r1", "h1")
    assert "h1" in cache.entries  # r2 still needs it
    cache.release_request("r2")
    assert cache.entries == {} and cache.num_tokens == 0


def test_block_hash_extra_keys_cover_the_blocks_a_span_overlaps():
    # blocks of 4: a span [3, 9) overlaps blocks 0, 1, 2; a span [12, 13) block 3
    assert mm_extra_keys([(3, 6, "x"), (12, 1, "y")], 4, 4) == [("x",), ("x",), ("x",), ("y",)]
    assert mm_extra_keys([(3, 6, "x")], 4, 1) == [("x",)]


@pytest.mark.parametrize("same_image", [True, False])
def test_prefix_cache_hits_only_with_the_same_image(same_image):
    eng = engine(budget=8, prefix=True)
    before = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full blocks of text, then the image at 10
    first, feats = request(before, (1, 4, 4), 0)
    eng.add_request("first", first, SamplingParams(temperature=0.0, max_tokens=2), mm_features=feats)
    eng.run()
    second, feats2 = request(before, (1, 4, 4), 0 if same_image else 1)
    assert second == first and (feats2[0].mm_hash == feats[0].mm_hash) == same_image
    stats = eng.scheduler.kv_cache_manager.stats
    hits = stats.hits
    eng.add_request("second", second, SamplingParams(temperature=0.0, max_tokens=2), mm_features=feats2)
    eng.run()
    hit = stats.hits - hits
    span_end = feats[0].mm_position.offset + feats[0].num_embeds
    if same_image:
        assert hit >= span_end // BLOCK * BLOCK, hit
    else:
        assert hit == feats[0].mm_position.offset // BLOCK * BLOCK == 8, hit


def test_engine_refuses_a_bad_image_up_front_and_graphs_with_images():
    import dataclasses

    from attnplug.core.errors import InvalidRequestError
    from attnplug.runner.execute.mm_inputs import multimodal_config

    eng = engine()
    prompt, (f,) = request([3], (1, 2, 4), 0)
    bad = dataclasses.replace(f, image_grid_thw=(1, 4, 4))  # 4 placeholder tokens' worth for a span of 2
    with pytest.raises(InvalidRequestError, match="mm_features.*span has grid"):
        eng.add_request("x", prompt, SamplingParams(max_tokens=1), mm_features=[bad])
    assert "x" not in eng.scheduler.requests
    with pytest.raises(ValueError, match="cudagraph_mode none"):
        multimodal_config(eng.runner.model, True)


def test_content_hash_follows_pixels_grid_and_dtype():
    from attnplug.runner.step.multimodal import mm_content_hash

    px = torch.randn(8, 24, generator=torch.Generator().manual_seed(0))
    h = mm_content_hash(px, (1, 2, 4))
    assert h == mm_content_hash(px.clone(), (1, 2, 4))
    assert len({h, mm_content_hash(px + 1e-3, (1, 2, 4)), mm_content_hash(px, (1, 4, 2)),
                mm_content_hash(px.bfloat16(), (1, 2, 4))}) == 4
