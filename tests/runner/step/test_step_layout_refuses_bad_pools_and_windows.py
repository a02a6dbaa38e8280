"""``StepCompiler``'s layout arguments (``runner/step/groups.py``, ``StepLayout.from_args``):
a ``num_blocks`` list of the wrong length or a pool under 2 blocks, and a sliding window
that is not a positive ``int`` (a ``bool`` or a float), and a kernel block size that is not a
positive ``int`` (0 included), are refused with ``KVCacheSpecError`` before anything is built."""

from __future__ import annotations

import pytest

from attnplug.core.errors import KVCacheSpecError
from attnplug.runner.step.compiler import StepCompiler


def _compiler(**kw) -> StepCompiler:
    return StepCompiler([4], max_num_reqs=2, max_model_len=16, max_num_batched_tokens=8, **kw)


@pytest.mark.parametrize("num_blocks", [[1], [8, 8], []])
def test_a_pool_list_of_the_wrong_length_or_under_two_blocks_is_refused(num_blocks):
    with pytest.raises(KVCacheSpecError, match=r"num_blocks must be >= 2 \(block 0 is the null block\) per group"):
        _compiler(num_blocks=num_blocks)


@pytest.mark.parametrize("window", [True, 3.5, 0])
def test_a_window_that_is_not_a_positive_int_is_refused(window):
    with pytest.raises(KVCacheSpecError, match="sliding_windows"):
        _compiler(num_blocks=8, group_kinds=["sliding_window"], sliding_windows=[window])


def test_a_positive_int_window_and_a_right_sized_pool_list_are_taken():
    sc = _compiler(num_blocks=[8], group_kinds=["sliding_window"], sliding_windows=[3])
    assert sc.sliding_windows == [3]


@pytest.mark.parametrize("kernel", [0, -4, 4.0])
def test_a_kernel_block_size_that_is_not_a_positive_int_is_refused(kernel):
    """Without ``num_blocks`` the default pool divides by the kernel expansion: a kernel
    block size of 0 still reaches the block tables' refusal, not a division by zero."""
    with pytest.raises(KVCacheSpecError, match=rf"kernel_block_size must be a positive int, got {kernel}$"):
        _compiler(kernel_block_sizes=[kernel])
