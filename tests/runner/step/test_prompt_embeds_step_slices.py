"""Prompt embeddings in the step compiler: each step's ``inputs_embeds`` holds exactly the
scheduled prompt rows of the requests given embeddings (``is_embed`` marks them; text
rows, output rows and padding are not marked); steps without such rows carry ``None``;
the caller's tensor is copied; a compiler built without a config refuses embeddings,
changing nothing. (Bad widths, dtypes, lengths: tests/runner/step/test_bad_input_fuzz.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.prompt_embeds import PromptEmbedsConfig
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

H = 4


def cached(rows):
    """``CachedRequestData`` of ``(req_id, num_computed_tokens)`` rows, no new blocks."""
    return CachedRequestData([r for r, _ in rows], [False] * len(rows), [[] for _ in rows], [None] * len(rows),
                             [n for _, n in rows])


@pytest.mark.parametrize("native", [True, False])
def test_each_step_carries_exactly_its_scheduled_prompt_rows(native):
    sc = StepCompiler([4], 4, 32, 16, num_blocks=64, native=native, validate=True,
                      prompt_embeds=PromptEmbedsConfig(H, torch.float32))
    e = torch.arange(10 * H, dtype=torch.float32).reshape(10, H) + 1
    given = e.clone()
    text = NewRequestData("t", [5, 6, 7], ([1, 5],))
    emb = NewRequestData("e", [0] * 10, ([2, 3, 4],), prompt_embeds=given)
    so = SchedulerOutput([text, emb], CachedRequestData(), {"t": 3, "e": 6})
    sc.update_states(so)
    given.zero_()  # the compiler keeps its own copy
    inp = sc.prepare_inputs(so, 12)  # padded to 12
    rows = {rid: i for i, rid in enumerate(inp.req_ids)}
    start = int(inp.query_start_loc_cpu[rows["e"]])
    want = torch.zeros(12, dtype=torch.bool)
    want[start:start + 6] = True
    assert torch.equal(inp.is_embed, want)
    assert torch.equal(inp.inputs_embeds[start:start + 6], e[:6])

    sc.append_output_tokens([rows["t"]], [9])  # "t" finished its prompt: decodes; "e" continues;
    u = NewRequestData("u", [1, 2, 3, 4, 5], ([6, 7],))  # a text request lands where "e" was
    so = SchedulerOutput([u], cached([("t", 3), ("e", 6)]), {"t": 1, "e": 4, "u": 5})
    sc.update_states(so)
    inp = sc.prepare_inputs(so)
    rows = {rid: i for i, rid in enumerate(inp.req_ids)}
    start = int(inp.query_start_loc_cpu[rows["e"]])
    assert int(inp.is_embed.sum()) == 4 and bool(inp.is_embed[start:start + 4].all())
    assert torch.equal(inp.inputs_embeds[start:start + 4], e[6:10])

    sc.append_output_tokens([rows["t"], rows["e"], rows["u"]], [9, 9, 9])
    so = SchedulerOutput([], cached([("t", 4), ("e", 10), ("u", 5)]), {"t": 1, "e": 1, "u": 1})
    sc.update_states(so)
    inp = sc.prepare_inputs(so)  # "e" decodes its output: an input_ids row
    assert inp.inputs_embeds is None and inp.is_embed is None
    sc.update_states(SchedulerOutput([], cached([]), {}, finished_req_ids={"e"}))
    assert not sc.prompt_embeds.embeds


def test_a_compiler_without_a_config_refuses_embeddings_and_changes_nothing():
    sc = StepCompiler([4], 4, 32, 16, num_blocks=64)
    sc.update_states(SchedulerOutput([NewRequestData("a", [1, 2], ([1],))], CachedRequestData(), {"a": 2}))
    before = sc.snapshot()
    bad = NewRequestData("b", [1, 2], ([2],), prompt_embeds=torch.zeros(2, H))
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.update_states(SchedulerOutput([bad], cached([("a", 0)]), {"a": 2, "b": 2}))
    assert (info.value.req_id, info.value.field) == ("b", "prompt_embeds")
    assert "PromptEmbedsConfig" in str(info.value)
    assert not snapshot_diff(sc.snapshot(), before)
    assert np.array_equal(sc.input_batch.num_computed_tokens_cpu[:1], [0])
