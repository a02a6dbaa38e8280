"""attnplug's sliding window ``W`` in the conventions of FlashAttention and FlashInfer.

attnplug (and HF ``config.sliding_window``) counts the current token: key ``k`` is
visible to the query at position ``p`` iff ``p - W < k <= p`` (``W`` keys). The kernel
libraries count the keys *left of* the query, inclusive bounds:

* FlashAttention ``window_size=(left, right)``: query ``i`` of a sequence with ``Lq``
  queries and ``Lk`` keys sees keys ``[i + Lk - Lq - left, i + Lk - Lq + right]``
  (inclusive; ``-1`` = unbounded). With the bottom-right causal mask the query sits at
  ``p = i + Lk - Lq``, so ``W`` tokens is ``(W - 1, 0)``.
* FlashInfer ``window_left``: the query at ``p`` sees keys ``[p - window_left, p]``
  (inclusive; ``-1`` = unbounded), so ``W`` tokens is ``W - 1``.

::

    W = 3, query at p = 6:   keys 4 5 6 visible      FA (2, 0)   FlashInfer window_left = 2

The arithmetic is ``attnplug.cache_groups.sliding_window``'s (one formula for the whole
project, next to the block pool's skip rule); this module adds the backends' error type
and FlashAttention's non-causal variant.
"""

from __future__ import annotations

from attnplug.cache_groups import sliding_window as _sw
from attnplug.core.errors import MetadataError

UNBOUNDED: int = -1
"""The libraries' "no window" value (``window_size=(-1, -1)``, ``window_left=-1``)."""


def _check(sliding_window: int | None) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise MetadataError(f"sliding_window must be a positive number of tokens or None, got {sliding_window!r}: "
                            "W counts the current token (HF config.sliding_window)")


def fa_window_size(sliding_window: int | None, causal: bool = True) -> tuple[int, int]:
    """FlashAttention's ``window_size`` for a window of ``sliding_window`` tokens.

    Args:
        sliding_window: ``W`` (current token included) or ``None`` for full attention.
        causal: the right bound is 0 for causal attention, unbounded (``-1``) otherwise.

    Returns:
        ``(W - 1, 0)`` (causal) or ``(W - 1, -1)``; ``(-1, -1)`` without a window.

    Raises:
        MetadataError: a non-positive window.

    Examples:
        >>> fa_window_size(3), fa_window_size(None), fa_window_size(1)
        ((2, 0), (-1, -1), (0, 0))
    """
    _check(sliding_window)
    left, right = _sw.flash_attn_window_size(sliding_window)
    return (left, right if causal or sliding_window is None else UNBOUNDED)


def flashinfer_window_left(sliding_window: int | None) -> int:
    """FlashInfer's ``window_left`` for a window of ``sliding_window`` tokens.

    Returns:
        ``W - 1``, or ``-1`` without a window.

    Raises:
        MetadataError: a non-positive window.

    Examples:
        >>> flashinfer_window_left(3), flashinfer_window_left(None)
        (2, -1)
    """
    _check(sliding_window)
    return _sw.flashinfer_window_left(sliding_window)
