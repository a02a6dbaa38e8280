"""The asynchronous patch runs inside the step's ``prepare`` (``StepKernels.prepare_patched``:
one pass on the compiled kernels, prepare then the patch's plan on the numpy ones): every
placeholder row gets its token from the previous step's tensor, whatever the rows'
order, a new request's prompt and the padding come out as without a patch, and a step
that ``prepare_inputs`` refuses (a token count that is not the batch's) or a sampled
tensor too short consumes no ``prev_sampled_index``: the right call afterwards patches."""

from __future__ import annotations

import pytest
import torch

from attnplug.core.errors import InvalidSchedulerOutput, MetadataError
from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.kernels import kernels_available
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

NATIVE = [False] + ([True] if kernels_available() else [])
SAMPLED = {"c": 30, "a": 10, "d": 40, "b": 20}
"""The previous step's sampled token of each request, in the order of its sampled tensor."""


def _compiler(native: bool) -> tuple[StepCompiler, SchedulerOutput]:
    """Four prefilled requests sampled in the order c, a, d, b (placeholders appended); the
    next output (applied, returned) finishes b, decodes a, c, d and admits e (a two-token
    prompt)."""
    sc = StepCompiler([4], 8, 32, 32, num_blocks=16, native=native)
    new = [NewRequestData(r, [i + 1, i + 2, i + 3], ([i + 1],), 0) for i, r in enumerate("abcd")]
    first = SchedulerOutput(new, CachedRequestData(), dict.fromkeys("abcd", 3))
    sc.update_states(first)
    sc.prepare_inputs(first)
    rows = [sc.input_batch.req_id_to_index[r] for r in SAMPLED]
    sc.append_placeholders(rows)
    second = SchedulerOutput([NewRequestData("e", [5, 6], ([9],), 0)],
                             CachedRequestData(["a", "c", "d"], [False] * 3, [[], [], []], [None] * 3, [3, 3, 3]),
                             {"a": 1, "c": 1, "d": 1, "e": 2}, finished_req_ids={"b"})
    sc.update_states(second)
    return sc, second


def _expected(sc: StepCompiler) -> list[int]:
    """Each row's tokens: a decoding request's sampled token, e's prompt."""
    out = []
    for rid in sc.input_batch.req_ids[:sc.input_batch.num_reqs]:
        out += [5, 6] if rid == "e" else [SAMPLED[rid]]
    return out


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])  # the kernel writes / the device copy does
@pytest.mark.parametrize("native", NATIVE)
def test_every_placeholder_row_is_patched_in_the_prepare_pass(native, dtype):
    sc, second = _compiler(native)
    prev = torch.tensor(list(SAMPLED.values()), dtype=dtype)
    inputs = sc.prepare_inputs(second, num_tokens_padded=8, prev_token_ids=prev)
    assert inputs.input_ids.tolist() == _expected(sc) + [0, 0, 0]  # padding after the 5 tokens
    assert inputs.positions.tolist()[:5] == [p for r in sc.input_batch.req_ids[:4] for p in ([0, 1] if r == "e" else [3])]
    assert sc.patch_counts == {"slice": 0, "scatter": 1}
    assert (sc.input_batch.prev_sampled_index[:4] == -1).all()  # consumed


@pytest.mark.parametrize("native", NATIVE)
def test_a_refused_step_consumes_nothing_and_the_right_call_patches(native):
    sc, second = _compiler(native)
    before = sc.input_batch.prev_sampled_index[:4].copy()
    assert (before >= 0).sum() == 3
    prev = torch.tensor(list(SAMPLED.values()), dtype=torch.int64)
    wrong = SchedulerOutput([], CachedRequestData(), {"a": 1})  # 1 token, the batch holds 5
    with pytest.raises(InvalidSchedulerOutput, match="total_num_scheduled_tokens"):
        sc.prepare_inputs(wrong, prev_token_ids=prev)
    assert sc.input_batch.prev_sampled_index[:4].tolist() == before.tolist()
    with pytest.raises(MetadataError, match="prev_token_ids holds 1 tokens"):  # shorter than the placeholders point into
        sc.prepare_inputs(second, prev_token_ids=prev[:1])
    assert sc.input_batch.prev_sampled_index[:4].tolist() == before.tolist()
    assert sc.prepare_inputs(second, prev_token_ids=prev).input_ids.tolist() == _expected(sc)
    assert sc.patch_counts == {"slice": 0, "scatter": 1}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("native", NATIVE)
def test_rows_in_order_take_each_its_own_token_by_the_slice(native, dtype):
    """Rows that kept their order (the steady state: the patch is ``dest == src == arange(k)``)
    get each its own sampled token; a request admitted behind them keeps its prompt, and a
    sampled tensor one token short (any integer dtype) refuses the step (the slice's one bound check)."""
    sc = StepCompiler([4], 8, 32, 32, num_blocks=16, native=native)
    new = [NewRequestData(r, [i + 1, i + 2, i + 3], ([i + 1],), 0) for i, r in enumerate("abc")]
    first = SchedulerOutput(new, CachedRequestData(), dict.fromkeys("abc", 3))
    sc.update_states(first)
    sc.prepare_inputs(first)
    sc.append_placeholders([0, 1, 2])
    second = SchedulerOutput([NewRequestData("e", [5, 6], ([9],), 0)],
                             CachedRequestData(["a", "b", "c"], [False] * 3, [[], [], []], [None] * 3, [3, 3, 3]),
                             {"a": 1, "b": 1, "c": 1, "e": 2})
    sc.update_states(second)
    prev = torch.tensor([11, 22, 33], dtype=dtype)
    with pytest.raises(MetadataError, match="prev_token_ids holds 2 tokens"):  # any dtype: checked before the patch
        sc.prepare_inputs(second, prev_token_ids=prev[:2])
    inputs = sc.prepare_inputs(second, prev_token_ids=prev)
    assert sc.input_batch.req_ids[:4] == ["a", "b", "c", "e"]
    assert inputs.input_ids.tolist() == [11, 22, 33, 5, 6]
    assert sc.patch_counts == {"slice": 1, "scatter": 0}


@pytest.mark.parametrize("native", NATIVE)
def test_a_strided_int64_tensor_is_copied_not_read_by_address(native):
    """The kernels write the tokens themselves only from a 1-D ``int64`` CPU tensor with
    unit stride (``numpy_kernels.writes_host_tokens``); a strided view (every other
    element) takes the device copy and still gives each row its own token."""
    sc, second = _compiler(native)
    doubled = torch.tensor([t for t in SAMPLED.values() for t in (t, -5)], dtype=torch.int64)
    inputs = sc.prepare_inputs(second, prev_token_ids=doubled[::2])
    assert inputs.input_ids.tolist() == _expected(sc)
    assert sc.patch_counts == {"slice": 0, "scatter": 1}
