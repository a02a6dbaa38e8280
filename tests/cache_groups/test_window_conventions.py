"""``cache_groups.sliding_window`` on its own: each kernel family's window argument, the
window check, the per-request block bound and the types each function returns (no runner,
no ATTNPLUG_VALIDATE). Key ``k`` is visible to the query at ``p`` iff ``p - W < k <= p``."""

from __future__ import annotations

import re

import numpy as np
import pytest

from attnplug.cache_groups.sliding_window import (
    first_visible_key,
    flash_attn_window_size,
    flashinfer_window_left,
    max_live_blocks,
    num_skipped_blocks,
    num_skipped_tokens,
    triton_sliding_window,
    window_from_flash_attn,
)
from attnplug.core.errors import KVCacheSpecError


@pytest.fixture(autouse=True)
def _no_validate(monkeypatch):
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)


@pytest.mark.parametrize("W", [1, 2, 7, 4096])
def test_each_kernel_family_gets_the_same_window_in_its_convention(W):
    # visibility from first principles: keys of the query at p are (p - W, p]
    p = 10_000
    visible = [k for k in range(p - W - 2, p + 2) if p - W < k <= p]
    left, right = flash_attn_window_size(W)  # inclusive [p - left, p + right]
    assert [k for k in range(p - W - 2, p + 2) if p - left <= k <= p + right] == visible and right == 0
    assert [k for k in range(p - W - 2, p + 2) if p - flashinfer_window_left(W) <= k <= p] == visible
    assert [k for k in range(p - W - 2, p + 2) if p - triton_sliding_window(W) < k <= p] == visible
    assert window_from_flash_attn((left, right)) == W
    assert first_visible_key(p, W) == visible[0]
    for f in (flash_attn_window_size, flashinfer_window_left, triton_sliding_window):
        assert f(np.int64(W)) == f(W)  # numpy ints are windows too
    assert type(flashinfer_window_left(np.int64(W))) is int and type(triton_sliding_window(np.int64(W))) is int
    assert [type(x) for x in flash_attn_window_size(np.int64(W))] == [int, int]


def test_full_attention_in_each_convention():
    assert flash_attn_window_size(None) == (-1, -1)
    assert flashinfer_window_left(None) == -1
    assert triton_sliding_window(None) == 0
    assert window_from_flash_attn((-1, -1)) is None
    assert window_from_flash_attn((np.int64(-1), np.int64(-1))) is None


MESSAGE = "sliding_window must be a positive int (tokens, current token included), got {!r}"


@pytest.mark.parametrize("bad", [0, -1, True, False, 2.0, "4", None])
def test_a_window_that_is_not_a_positive_int_is_rejected_everywhere(bad):
    calls = [lambda: num_skipped_tokens(5, bad), lambda: num_skipped_blocks(5, bad, 4),
             lambda: max_live_blocks(bad, 8, 4), lambda: first_visible_key(5, bad)]
    if bad is not None:  # None is full attention for the kernel conventions
        calls += [lambda: flash_attn_window_size(bad), lambda: flashinfer_window_left(bad),
                  lambda: triton_sliding_window(bad)]
    for call in calls:
        with pytest.raises(KVCacheSpecError, match="^" + re.escape(MESSAGE.format(bad)) + "$"):
            call()


def test_the_smallest_window_sees_only_the_current_token():
    assert num_skipped_tokens(0, 1) == 0 and num_skipped_tokens(7, 1) == 7  # every key before the query
    assert flash_attn_window_size(1) == (0, 0) and flashinfer_window_left(1) == 0


@pytest.mark.parametrize("window_size", [(3, 2), (-2, 0), (-1, 0), (0, -1), (5, 1)])
def test_only_causal_windows_come_back_from_flash_attn(window_size):
    with pytest.raises(KVCacheSpecError, match="^" + re.escape(
            f"window_size {window_size!r} is not a causal sliding window (left >= 0, right == 0)") + "$"):
        window_from_flash_attn(window_size)


def test_scalars_stay_ints_and_arrays_stay_arrays():
    assert type(num_skipped_tokens(np.int64(9), 6)) is int and num_skipped_tokens(np.int64(9), 6) == 4
    out = num_skipped_tokens(np.array([0, 5, 6, 9]), 6)
    assert isinstance(out, np.ndarray) and out.tolist() == [0, 0, 1, 4]
    assert num_skipped_blocks(np.array([8, 9, 13]), 6, 4).tolist() == [0, 1, 2]
    assert first_visible_key(np.array([0, 6, 7]), 6).tolist() == [0, 1, 2]


@pytest.mark.parametrize("W, M, B", [(1, 1, 1), (10, 6, 4), (5, 4, 4), (4, 5, 4), (16, 1, 16), (3, 9, 2)])
def test_max_live_blocks_bounds_a_simulated_request(W, M, B):
    # a request advancing by up to M tokens a step holds blocks from its first visible key
    # (at most W - 1 tokens back) through its last new token
    worst = 0
    for n in range(0, 4 * (W + M + B)):
        for step in range(1, M + 1):
            first = num_skipped_tokens(n, W) // B  # blocks before this one were freed
            last = (n + step - 1) // B
            worst = max(worst, last - first + 1)
    assert max_live_blocks(W, M, B) == -(-(W - 1 + M) // B) + 1
    assert worst <= max_live_blocks(W, M, B) <= worst + 1
