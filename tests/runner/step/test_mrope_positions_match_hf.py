"""M-RoPE positions: the step compiler's ``[3, P]`` positions equal transformers' own
``Qwen2VLModel.get_rope_index`` (called here, on a tiny random Qwen2-VL) for random image
grids and text gaps — per prompt, and per step when chunked prefill cuts an image span,
for the continuation after the prompt (``position + delta``), for text requests mixed in
(all three sections equal), and bad spans are refused naming the field, changing nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.mrope import PlaceholderRange, mrope_prompt_positions
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

MERGE, IMAGE_TOKEN = 2, 7


@pytest.fixture(scope="module")
def hf_model():
    tr = pytest.importorskip("transformers")
    cfg = tr.Qwen2VLConfig(
        text_config=dict(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, spatial_merge_size=MERGE),
        image_token_id=IMAGE_TOKEN)
    return tr.Qwen2VLModel(cfg).eval()


def random_prompt(rng: np.random.Generator):
    """``(prompt, placeholders)``: 1-3 images (grids after the merge) between text gaps."""
    prompt, ph = [], []
    for i in range(rng.integers(1, 4)):  # text between images (a vision-start token in Qwen2-VL)
        prompt += [1] * int(rng.integers(0 if i == 0 else 1, 5))
        grid = (int(rng.integers(1, 3)), int(rng.integers(1, 5)), int(rng.integers(1, 5)))
        ph.append(PlaceholderRange(len(prompt), grid))
        prompt += [IMAGE_TOKEN] * (grid[0] * grid[1] * grid[2])
    prompt += [1] * int(rng.integers(0, 5))
    return prompt, ph


def hf_positions(model, prompt, ph):
    ids = torch.tensor([prompt])
    types = (ids == IMAGE_TOKEN).int()
    grids = torch.tensor([[t, h * MERGE, w * MERGE] for t, h, w in (p.grid_thw for p in ph)])
    pos, delta = model.get_rope_index(ids, types, image_grid_thw=grids)
    return pos[:, 0].numpy(), int(delta.reshape(-1)[0])


def test_prompt_positions_and_delta_equal_hf_on_random_grids(hf_model):
    rng = np.random.default_rng(0)
    for _ in range(25):
        prompt, ph = random_prompt(rng)
        got, delta = mrope_prompt_positions(len(prompt), ph)
        want, want_delta = hf_positions(hf_model, prompt, ph)
        assert np.array_equal(got, want), (ph, got, want)
        assert delta == want_delta


@pytest.mark.parametrize("native", [True, False])
def test_step_positions_under_chunking_and_decode_equal_hf(hf_model, native):
    rng = np.random.default_rng(1)
    prompt, ph = random_prompt(rng)
    while len(prompt) < 12:
        prompt, ph = random_prompt(rng)
    want, delta = hf_positions(hf_model, prompt, ph)
    L, chunk = len(prompt), 5  # 5-token chunks cut image spans
    assert any(p.offset // chunk != (p.offset + p.length - 1) // chunk for p in ph)
    sc = StepCompiler([4], 2, 64, 8, num_blocks=64, native=native, validate=True, uses_mrope=True)
    blocks = list(range(1, 1 + (L + 4) // 4 + 1))
    text = NewRequestData("t", [1, 2, 3], ([40, 41],))
    img = NewRequestData("i", prompt, (blocks,), mm_placeholders=ph)
    so = SchedulerOutput([text, img], CachedRequestData(), {"t": 3, "i": chunk})
    sc.update_states(so)
    done, got, t_ncc = 0, [], 3
    while True:
        inp = sc.prepare_inputs(so)
        rows = {rid: r for r, rid in enumerate(inp.req_ids)}
        s, n = int(inp.query_start_loc_cpu[rows["i"]]), int(inp.num_scheduled_tokens[rows["i"]])
        got.append(inp.mrope_positions[:, s:s + n].numpy().copy())
        ts = int(inp.query_start_loc_cpu[rows["t"]])
        tn = int(inp.num_scheduled_tokens[rows["t"]])
        assert np.array_equal(inp.mrope_positions[:, ts:ts + tn].numpy(), np.tile(inp.positions_cpu[ts:ts + tn], (3, 1)))
        done += n
        keep = [r for r in range(inp.num_reqs) if not inp.discard[r]]
        sc.append_output_tokens(keep, [1] * len(keep))
        if done >= L + 2:
            break
        n_next = min(chunk, L - done) if done < L else 1
        so = SchedulerOutput([], CachedRequestData(["t", "i"], [False, False], [[], []], [None, None],
                                                   [t_ncc, done]), {"t": 1, "i": n_next})
        t_ncc += 1
        sc.update_states(so)
    got = np.concatenate(got, axis=1)
    assert np.array_equal(got[:, :L], want)
    assert np.array_equal(got[:, L:], np.tile(np.arange(L, done) + delta, (3, 1)))


def test_bad_spans_are_refused_and_change_nothing():
    sc = StepCompiler([4], 2, 64, 16, num_blocks=64, uses_mrope=True)
    before = sc.snapshot()
    for ph in ([PlaceholderRange(2, (1, 2, 2))],           # 4 tokens past a 5-token prompt
               [PlaceholderRange(0, (1, 1, 2)), PlaceholderRange(1, (1, 1, 1))],  # overlap
               [PlaceholderRange(0, (1, 0, 2))], [(0, (1, 1, 1))]):
        bad = NewRequestData("a", [1] * 5, ([1, 2],), mm_placeholders=ph)
        with pytest.raises(InvalidSchedulerOutput) as info:
            sc.update_states(SchedulerOutput([bad], CachedRequestData(), {"a": 5}))
        assert (info.value.req_id, info.value.field) == ("a", "mm_placeholders")
        assert not snapshot_diff(sc.snapshot(), before)
    plain = StepCompiler([4], 2, 64, 16, num_blocks=64)
    with pytest.raises(InvalidSchedulerOutput, match="uses_mrope"):
        plain.update_states(SchedulerOutput([NewRequestData("a", [1] * 5, ([1, 2],),
                                                            mm_placeholders=[PlaceholderRange(0, (1, 1, 1))])],
                                            CachedRequestData(), {"a": 5}))
