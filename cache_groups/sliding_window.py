"""Sliding-window arithmetic: which tokens and blocks a window can still see, and the
window in each kernel family's own convention.

Convention everywhere in attnplug (HF ``config.sliding_window``): a window of ``W``
tokens includes the current token, so key ``k`` is visible to the query at position
``p`` iff ``p - W < k <= p``.

Skipping. After ``n`` computed tokens every future query sits at position ``n`` or
later, so keys ``0 .. n - W`` — :func:`num_skipped_tokens` ``= max(0, n - W + 1)`` of them
— are never read again, and the whole blocks before that point
(:func:`num_skipped_blocks`) can be freed: the block pool gives them back and puts
``NULL_BLOCK_ID`` in their place, the runner nulls them in its block table, and a backend
never reads them. The block table never shifts: logical block ``i`` always covers tokens
``[i * B, (i + 1) * B)``. A request then holds at most :func:`max_live_blocks` blocks.

Kernel conventions (upstream: flash-attn's ``window_size=(left, right)``, FlashInfer's
``window_left`` in its ``plan()`` docstrings; docs/backends.md). For a ``W``-token window:

==================================  ================================  ==================
kernel                              argument                          value
==================================  ================================  ==================
flash-attn 2/3 (``window_size``)    ``(left, right)``, inclusive      ``(W - 1, 0)``
FlashInfer ``plan(window_left=)``   keys left of the query, incl.     ``W - 1``
attnplug Triton (``SLIDING_WINDOW``) tokens, current included         ``W``
attnplug ``torch_native``           tokens, current included          ``W``
==================================  ================================  ==================

and full attention is ``(-1, -1)``, ``-1``, ``0`` and ``None`` respectively.

Every function accepts Python ints or numpy integer arrays (elementwise), so the block
pool (one request) and the runner (all rows at once, no Python loop) share one formula.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from attnplug.core.errors import KVCacheSpecError

IntOrArray = TypeVar("IntOrArray", int, np.ndarray)


def _check_window(sliding_window: int) -> None:
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, np.integer)) or sliding_window <= 0:
        raise KVCacheSpecError(
            f"sliding_window must be a positive int (tokens, current token included), got {sliding_window!r}")


def num_skipped_tokens(num_computed_tokens: IntOrArray, sliding_window: int) -> IntOrArray:
    """Leading tokens no future query can see: ``max(0, n - W + 1)``.

    Args:
        num_computed_tokens: ``n``, tokens whose K/V is cached (int or int array).
        sliding_window: ``W`` tokens, current token included.

    Returns:
        Same type and shape as ``num_computed_tokens``.

    Raises:
        KVCacheSpecError: ``W`` is not a positive int.

    Examples:
        >>> num_skipped_tokens(9, 6), num_skipped_tokens(3, 6)
        (4, 0)
    """
    _check_window(sliding_window)
    if isinstance(num_computed_tokens, np.ndarray):
        return np.maximum(num_computed_tokens - (sliding_window - 1), 0)
    return max(0, int(num_computed_tokens) - sliding_window + 1)


def num_skipped_blocks(num_computed_tokens: IntOrArray, sliding_window: int, block_size: int) -> IntOrArray:
    """Leading whole blocks no future query can see: ``max(0, n - W + 1) // B``.

    These are the logical blocks ``0 .. num_skipped_blocks - 1`` that hold
    ``NULL_BLOCK_ID`` once freed.

    Examples:
        >>> num_skipped_blocks(13, 6, 4)   # tokens 0..7 skippable -> blocks 0 and 1
        2
        >>> num_skipped_blocks(np.array([0, 9, 13]), 6, 4).tolist()
        [0, 1, 2]
    """
    return num_skipped_tokens(num_computed_tokens, sliding_window) // int(block_size)


def first_visible_key(query_position: IntOrArray, sliding_window: int) -> IntOrArray:
    """The first key position the query at ``query_position`` sees: ``max(0, p - W + 1)``.

    For a request whose first query this step is at ``num_computed_tokens``, this equals
    :func:`num_skipped_tokens` — the skipped tokens are exactly the ones no query reads.
    """
    return num_skipped_tokens(query_position, sliding_window)


def max_live_blocks(sliding_window: int, max_num_batched_tokens: int, block_size: int) -> int:
    """Most blocks one request holds at once: ``cdiv(W - 1 + max_num_batched_tokens, B) + 1``.

    Before a step the request keeps tokens from its first visible key on (at most
    ``W - 1`` of them) and adds at most ``max_num_batched_tokens``; the ``+ 1`` is the
    block that the first kept token may share with skipped tokens.

    Examples:
        >>> max_live_blocks(10, 6, 4)
        5
    """
    _check_window(sliding_window)
    return -(-(sliding_window - 1 + max_num_batched_tokens) // block_size) + 1


# --- the window in each kernel family's convention ---------------------------------------
def flash_attn_window_size(sliding_window: int | None) -> tuple[int, int]:
    """flash-attn ``window_size=(left, right)`` (inclusive bounds): ``(W - 1, 0)``;
    ``(-1, -1)`` for full attention. Query ``i`` then sees keys
    ``[i + Lk - Lq - left, i + Lk - Lq + right]``.

    Examples:
        >>> flash_attn_window_size(4096), flash_attn_window_size(None)
        ((4095, 0), (-1, -1))
    """
    if sliding_window is None:
        return (-1, -1)
    _check_window(sliding_window)
    return (int(sliding_window) - 1, 0)


def flashinfer_window_left(sliding_window: int | None) -> int:
    """FlashInfer ``plan(..., window_left=)``: keys to the left of the query, inclusive:
    ``W - 1``; ``-1`` for full attention.

    Examples:
        >>> flashinfer_window_left(4096), flashinfer_window_left(None)
        (4095, -1)
    """
    if sliding_window is None:
        return -1
    _check_window(sliding_window)
    return int(sliding_window) - 1


def triton_sliding_window(sliding_window: int | None) -> int:
    """The attnplug Triton kernels' ``SLIDING_WINDOW`` constexpr: ``W`` tokens (current
    included); ``0`` for full attention. (vLLM's unified Triton kernel calls the same
    number ``1 + window_left``.)

    Examples:
        >>> triton_sliding_window(4096), triton_sliding_window(None)
        (4096, 0)
    """
    if sliding_window is None:
        return 0
    _check_window(sliding_window)
    return int(sliding_window)


def window_from_flash_attn(window_size: tuple[int, int]) -> int | None:
    """Inverse of :func:`flash_attn_window_size` for causal windows: ``left + 1``.

    Raises:
        KVCacheSpecError: a window with ``right != 0`` (not causal) or a negative left
            other than the full-attention ``(-1, -1)``.
    """
    left, right = int(window_size[0]), int(window_size[1])
    if (left, right) == (-1, -1):
        return None
    if right != 0 or left < 0:
        raise KVCacheSpecError(f"window_size {window_size!r} is not a causal sliding window (left >= 0, right == 0)")
    return left + 1
