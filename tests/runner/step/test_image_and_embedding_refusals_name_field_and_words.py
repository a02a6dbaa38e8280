"""A new request's images and prompt embeddings that the step compiler cannot take are
refused naming the request, the field (``mm_placeholders``, ``mm_features``,
``prompt_embeds``) and the rule, word for word, on both kernel paths, and change nothing:
placeholders for a compiler built without ``uses_mrope``, placeholders that are not
``PlaceholderRange``s or whose grid is not three ints >= 1, an image whose ``mm_position``
is not a ``PlaceholderRange`` or lies outside the prompt (the span rule worded for
``mm_features``), embeddings that are not a tensor."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.mrope import PlaceholderRange
from attnplug.runner.step.multimodal import MultiModalConfig, image_feature
from attnplug.runner.step.prompt_embeds import PromptEmbedsConfig
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

PATHS = [False] + ([True] if NATIVE is not None else [])
IMAGE = image_feature(torch.zeros(4, 3), (1, 2, 2), 1, 2)  # one placeholder token at position 1

CASES = [  # (name, compiler options, request fields, field, message after "request 'a': <field>: ")
    ("placeholders without uses_mrope", {}, dict(mm_placeholders=[PlaceholderRange(0, (1, 1, 1))]),
     "mm_placeholders", "this step compiler computes no M-RoPE positions (uses_mrope=False)"),
    ("placeholders as tuples", dict(uses_mrope=True), dict(mm_placeholders=[(0, (1, 1, 1))]),
     "mm_placeholders", "expected a list of PlaceholderRange, got [(0, (1, 1, 1))]"),
    ("a grid with a 0", dict(uses_mrope=True), dict(mm_placeholders=[PlaceholderRange(0, (1, 0, 2))]),
     "mm_placeholders", "item 0: grid_thw must be three ints >= 1, got (1, 0, 2)"),
    ("an image's span as a tuple", dict(multimodal=MultiModalConfig(2, 3)),
     dict(mm_features=[dataclasses.replace(IMAGE, mm_position=(1, (1, 1, 1)))]),
     "mm_features", "item 0: mm_position must be a PlaceholderRange, got (1, (1, 1, 1))"),
    ("an image's span past the prompt", dict(multimodal=MultiModalConfig(2, 3)),
     dict(mm_features=[dataclasses.replace(IMAGE, mm_position=PlaceholderRange(6, (1, 1, 1)))]),
     "mm_features", "mm_position item 0: span [6, +1) must lie inside the prompt [0, 6) after the previous span "
     "(ending at 0)"),
    ("embeddings as a list", dict(prompt_embeds=PromptEmbedsConfig(4, torch.float32)),
     dict(prompt_embeds=[[0.0] * 4] * 6), "prompt_embeds",
     "expected a torch.Tensor [num_prompt_tokens, hidden_size], got " + repr([[0.0] * 4] * 6)),
]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name, options, fields, field, words", CASES, ids=[c[0] for c in CASES])
def test_a_refused_image_or_embedding_names_request_field_and_rule(native, name, options, fields, field, words):
    sc = StepCompiler([4], 2, 32, 16, native=native, **options)
    before = sc.snapshot()
    so = SchedulerOutput([NewRequestData("a", [1] * 6, ([1, 2],), **fields)], CachedRequestData(), {"a": 6})
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.update_states(so)
    assert (info.value.req_id, info.value.field) == ("a", field), str(info.value)
    assert str(info.value) == f"request 'a': {field}: {words}"
    assert not snapshot_diff(before, sc.snapshot())


@pytest.mark.parametrize("native", PATHS)
def test_the_valid_image_of_the_cases_is_taken(native):
    sc = StepCompiler([4], 2, 32, 16, native=native, multimodal=MultiModalConfig(2, 3))
    so = SchedulerOutput([NewRequestData("a", [1] * 6, ([1, 2],), mm_features=[IMAGE])], CachedRequestData(), {"a": 6})
    sc.update_states(so)
    assert [(s.dest, s.start, s.length) for s in sc.prepare_inputs(so).mm_slices] == [(1, 0, 1)]
