"""The asynchronous patch and the drafts' layout are kernel operations: the compiled and the
numpy kernels give the same ``input_ids`` / ``SpecDecodeMetadata``, whether the kernel
writes the previous step's tokens itself (a CPU device, ``int64`` tokens) or the device
copy does (other dtypes), and whether the drafts' dict lists its requests in the cached
order or not. Filling the placeholders skips a finished request."""

from __future__ import annotations

import pytest
import torch

from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.kernels import kernels_available
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

NATIVE = [False] + ([True] if kernels_available() else [])


def _patched(native: bool, dtype: torch.dtype) -> tuple[list[int], dict, list[int]]:
    sc = StepCompiler([4], 4, 32, 32, num_blocks=16, native=native)
    new = [NewRequestData(r, [1, 2, 3], ([i + 1],), 0) for i, r in enumerate("abc")]
    first = SchedulerOutput(new, CachedRequestData(), dict.fromkeys("abc", 3))
    sc.update_states(first)
    sc.prepare_inputs(first)
    ph = sc.append_placeholders([0, 1, 2])
    # "a" finishes: "c" moves into row 0, so the patch is a scatter (src 2 -> dest 0)
    second = SchedulerOutput([], CachedRequestData(["b", "c"], [False] * 2, [[], []], [None, None], [3, 3]),
                             {"b": 1, "c": 1}, finished_req_ids={"a"})
    sc.update_states(second)
    inputs = sc.prepare_inputs(second, prev_token_ids=torch.tensor([21, 22, 23], dtype=dtype))
    assert sc.fill_output_tokens(ph, [21, 22, 23]) == 2  # "a" finished: skipped
    b = sc.input_batch
    assert b.token_ids_cpu[[0, 1], 3].tolist() == [23, 22]
    return inputs.input_ids.tolist(), dict(sc.patch_counts), b.prev_sampled_index[:2].tolist()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_the_patch_is_the_same_on_both_kernels_written_by_the_kernel_or_copied(dtype):
    for native in NATIVE:
        ids, counts, prev_index = _patched(native, dtype)
        assert ids == [23, 22], (native, dtype)  # rows c, b: their tokens from the previous step
        assert counts == {"slice": 0, "scatter": 1}
        assert prev_index == [-1, -1]  # consumed


def _draft_step(native: bool, order: tuple[str, ...]):
    sc = StepCompiler([4], 4, 32, 32, num_blocks=16, native=native)
    new = [NewRequestData("a", list(range(7)), ([1, 2],), 6), NewRequestData("b", list(range(8)), ([3, 4],), 7),
           NewRequestData("c", [5, 6], ([5],), 1)]
    first = SchedulerOutput(new, CachedRequestData(), {"a": 1, "b": 1, "c": 1})
    sc.update_states(first)
    sc.prepare_inputs(first)
    sc.append_output_tokens(["a", "b", "c"], [7, 8, 9])
    drafts = {"a": [11, 12, 13], "c": [14]}
    cached = CachedRequestData(["a", "b", "c"], [False] * 3, [[], [], []], [([7],), ([6],), None], [7, 8, 2])
    so = SchedulerOutput([], cached, {"a": 4, "b": 1, "c": 2},
                         scheduled_spec_decode_tokens={r: drafts[r] for r in order})
    sc.update_states(so)
    return sc.checker.last_scanned, sc.prepare_inputs(so)


@pytest.mark.parametrize("order", [("a", "c"), ("c", "a")])
def test_drafts_in_or_out_of_the_cached_order_give_the_same_layout(order):
    results = [_draft_step(native, order) for native in NATIVE]
    for native, (scanned, inputs) in zip(NATIVE, results):
        assert scanned == native  # the compiled scan plans either order
        m = inputs.spec_decode_metadata
        assert inputs.input_ids.tolist() == [7, 11, 12, 13, 8, 9, 14]
        assert m.num_draft_tokens == [3, 0, 1]
        assert m.draft_token_ids.tolist() == [11, 12, 13, 14]
        assert m.cu_num_draft_tokens.tolist() == [3, 3, 4]
        assert m.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 6]
        assert m.target_logits_indices.tolist() == [0, 1, 2, 5]
        assert m.bonus_logits_indices.tolist() == [3, 4, 6]
