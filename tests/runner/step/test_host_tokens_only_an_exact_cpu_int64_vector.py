"""``StepKernels.host_tokens`` gives an address only for what the kernel may read in place.

The compiled kernels read the asynchronous patch's tensor through DLPack's C exchange API
(``runner/step/fast/_native_dlpack.pxi``): one call for its type, device, dtype, shape and
strides. It must say yes exactly when torch's own attributes say the tensor is a 1-D
``int64`` CPU vector of ``n`` tokens at unit stride, and give that tensor's ``data_ptr()``;
anything else goes through ``placeholders.prev_tokens_tensor`` (which words or converts
it), so a yes too many is an out-of-bounds or misread host buffer and a no too many only
a slower step. The usual CPU tensor must take the one call, not the checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.runner.step import compiler as compiler_module
from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.kernels import choose_kernels, kernels_available
from attnplug.runner.step.numpy_kernels import NumpyKernels
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput

needs_native = pytest.mark.skipif(not kernels_available(), reason="compiled step kernels not built")


class _Sub(torch.Tensor):
    """A tensor subclass: the exchange API is torch.Tensor's, not its subclasses'."""


def _reference(t, n: int) -> int:
    """The rule by torch's attributes: exactly ``torch.Tensor``, CPU, ``int64``, 1-D,
    ``n`` elements, unit stride unless ``n <= 1``, memory unless ``n = 0``."""
    if type(t) is not torch.Tensor or n < 0 or t.device.type != "cpu" or t.layout != torch.strided:
        return -1
    if t.dtype != torch.int64 or t.dim() != 1 or t.shape[0] != n or (n > 1 and t.stride(0) != 1):
        return -1
    return -1 if n and not t.data_ptr() else t.data_ptr()  # (elements but no memory: refused)


def _candidates():
    """``(label, object, n)``: every refusal reason, and the shapes that pass."""
    base = torch.arange(12, dtype=torch.int64)
    out = [("plain", base, 12), ("tail view", base[3:], 9), ("one element", base[5:6], 1),
           ("one element, strided", base[::7][1:], 1), ("empty", base[:0], 0),
           ("row of a matrix", base.view(3, 4)[1], 4), ("wrong length, short", base, 11),
           ("wrong length, long", base, 13), ("negative n", base, -1), ("strided", base[::2], 6),
           ("column of a matrix", base.view(3, 4)[:, 1], 3), ("expanded", base[:1].expand(4), 4),
           ("2-D", base.view(3, 4), 3), ("0-D", base[0], 1), ("meta", torch.empty(4, dtype=torch.int64, device="meta"), 4),
           ("subclass", base.as_subclass(_Sub), 12), ("list", list(range(4)), 4),
           ("numpy", np.arange(4), 4), ("None", None, 0)]
    for dtype in (torch.int32, torch.int16, torch.uint8, torch.uint64, torch.bool, torch.float64, torch.float32,
                  torch.complex64):
        out.append((f"dtype {dtype}", torch.zeros(4, dtype=dtype), 4))
    sparse = torch.tensor([1, 0, 3], dtype=torch.int64).to_sparse()
    out.append(("sparse", sparse, 3))
    out.append(("zero tensor (no memory)", torch._efficientzerotensor(4, dtype=torch.int64), 4))
    return out


@needs_native
@pytest.mark.parametrize("label,obj,n", _candidates(), ids=[c[0] for c in _candidates()])
def test_the_compiled_answer_is_the_attribute_rule(label, obj, n):
    kernels = choose_kernels(None, SamplingParams)
    assert kernels.name == "compiled"
    assert kernels.host_tokens(obj, n) == _reference(obj, n), label


def test_the_numpy_kernels_never_read_in_place():
    assert NumpyKernels().host_tokens(torch.arange(4), 4) == -1


def _two_steps(native: bool) -> tuple[StepCompiler, SchedulerOutput]:
    """Three prefilled requests, placeholders appended in the order c, a, b; the next
    decode step applied."""
    sc = StepCompiler([4], 8, 32, 32, num_blocks=16, native=native)
    new = [NewRequestData(r, [i + 1, i + 2], ([i + 1],), 0) for i, r in enumerate("abc")]
    first = SchedulerOutput(new, CachedRequestData(), dict.fromkeys("abc", 2))
    sc.update_states(first)
    sc.prepare_inputs(first)
    sc.append_placeholders([sc.input_batch.req_id_to_index[r] for r in "cab"])
    second = SchedulerOutput([], CachedRequestData(list("abc"), [False] * 3, [[]] * 3, [None] * 3, [2, 2, 2]),
                             dict.fromkeys("abc", 1))
    sc.update_states(second)
    return sc, second


@needs_native
def test_the_usual_cpu_tensor_skips_the_attribute_checks(monkeypatch):
    """A 1-D ``int64`` CPU tensor is read in place: ``prev_tokens_tensor`` is not called,
    and each row still gets its own token."""
    sc, second = _two_steps(True)

    def refuse(*args):
        raise AssertionError("the usual tensor went through prev_tokens_tensor")

    monkeypatch.setattr(compiler_module, "prev_tokens_tensor", refuse)
    inputs = sc.prepare_inputs(second, prev_token_ids=torch.tensor([30, 10, 20]))
    assert inputs.input_ids.tolist() == [10, 20, 30]


@pytest.mark.parametrize("native", [False] + ([True] if kernels_available() else []))
@pytest.mark.parametrize("make", [lambda v: torch.tensor(v, dtype=torch.int32),
                                  lambda v: torch.tensor([x for t in v for x in (t, -1)])[::2],
                                  lambda v: torch.tensor(v).as_subclass(_Sub)],
                         ids=["int32", "strided", "subclass"])
def test_a_tensor_refused_in_place_is_checked_and_still_patched(native, make):
    sc, second = _two_steps(native)
    inputs = sc.prepare_inputs(second, prev_token_ids=make([30, 10, 20]))
    assert inputs.input_ids.tolist() == [10, 20, 30]
