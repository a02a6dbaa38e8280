"""Each step's ``mm_slices`` (``runner/step/multimodal.py``'s ``MMSlice``) give the rows of an
image that the step's placeholder tokens take, and ``completes`` is true only for the slice
that reaches the span's last token (the encoder cache frees the image after it): a chunked
prefill that cuts the span completes it in its second chunk, and a step past the span has no
slice."""

from __future__ import annotations

import pytest
import torch

from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.multimodal import MultiModalConfig, image_feature
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

PATHS = [False] + ([True] if NATIVE is not None else [])


@pytest.mark.parametrize("native", PATHS)
def test_the_chunk_that_reaches_the_spans_last_token_completes_it(native):
    """t (3 text tokens, then decoding) and i (10 tokens: a 4-token image span at 2..5),
    i prefilled in chunks of 4, 4, 2."""
    sc = StepCompiler([4], 2, 32, 16, native=native, validate=True, multimodal=MultiModalConfig(2, 3))
    image = image_feature(torch.arange(48, dtype=torch.float32).reshape(16, 3), (1, 4, 4), 2, 2)
    assert (image.mm_position.offset, image.num_embeds) == (2, 4)
    so = SchedulerOutput([NewRequestData("t", [1, 2, 3], ([1, 5],)),
                          NewRequestData("i", [1, 8, 9, 9, 9, 9, 8, 5, 6, 7], ([2, 3, 4],), mm_features=[image])],
                         CachedRequestData(), {"t": 3, "i": 4})
    want = [[("i", 5, 0, 2, False)], [("i", 1, 2, 2, True)], []]  # (req, dest, start, length, completes)
    for step, (t_ncc, i_ncc, i_count) in enumerate([(0, 0, 4), (3, 4, 4), (4, 8, 2)]):
        if step:
            so = SchedulerOutput([], CachedRequestData(["t", "i"], [False] * 2, [[], []], [None, None],
                                                       [t_ncc, i_ncc]), {"t": 1, "i": i_count})
        sc.update_states(so)
        inputs = sc.prepare_inputs(so)
        assert inputs.req_ids == ["t", "i"]
        got = [(s.req_id, s.dest, s.start, s.length, s.completes) for s in inputs.mm_slices]
        assert got == want[step], step
        assert all(s.feature is image for s in inputs.mm_slices)
        sc.append_output_tokens(["t"], [4])
