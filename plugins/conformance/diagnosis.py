"""What a wrong (finite) output says about the bug: sentences appended to a failure.

Two patterns are recognised in the values of one step and cache group:

* **The poison value.** A request's unwritten slots (the tail of its last block) and its
  keys no query of the step can see (before a sliding window) hold ``POISON``
  (``harness.py``) as K and V. A query that attends to one of them gets a logit of
  ``scale * 1000 * sum(q)``, which either vanishes or takes all the softmax weight: the
  output is then exactly ``POISON``. So wrong values equal to it mean the backend read
  keys outside the visible range (past the query's position or ``seq_len``, or before its
  window).
* **Heads.** Which query heads are wrong and which are right; with GQA/MQA, a wrong head
  whose output matches the dense oracle computed over *another* KV head is a head-mapping
  bug (query head ``h`` must read KV head ``h // (num_heads // num_kv_heads)``, HF
  ``repeat_kv``'s convention), and the message names the KV head it read.
"""

from __future__ import annotations

import numpy as np
import torch

from attnplug.plugins.conformance.harness import POISON, CaseRun
from attnplug.plugins.conformance.oracle import CaseInputs, dense_attention

MAX_HEADS_LISTED = 8


def _heads(heads: list[int]) -> str:
    return ", ".join(map(str, heads[:MAX_HEADS_LISTED])) + (" ..." if len(heads) > MAX_HEADS_LISTED else "")


def poison_sentence(got: torch.Tensor, bad: torch.Tensor) -> str:
    """A sentence when wrong values of ``got`` (``[tokens, heads, dims]`` float64, ``bad`` its
    mask of wrong values) equal ``POISON``; else ``""``."""
    hits = bad & ((got - POISON).abs() <= 1e-3 * POISON)
    n = int(hits.sum())
    if not n:
        return ""
    return (f"; {n} of the wrong values are {POISON:g}, the poison value of a request's unwritten and "
            "out-of-window slots: the backend attended to keys outside the visible range (past the query's "
            "position or the request's seq_len, or before its sliding window)")


def heads_sentence(run: CaseRun, token_req: np.ndarray, token_pos: np.ndarray, got: torch.Tensor,
                   bad: torch.Tensor, tolerance: tuple[float, float]) -> str:
    """Which query heads are wrong and right, and for GQA/MQA which KV head a wrong head
    read instead (``""`` for a single-head layer).

    Args:
        run: the run (its case gives the heads and inputs).
        token_req, token_pos: ``[tokens]`` request index and position of each row of ``got``.
        got: ``[tokens, num_heads, head_size]`` float64 output.
        bad: same shape, bool: the values outside tolerance.
        tolerance: ``(atol, rtol)`` of the case's dtype.
    """
    case = run.case
    if case.num_heads == 1:
        return ""
    wrong = torch.nonzero(bad.any(dim=0).any(dim=-1)).flatten().tolist()
    right = [h for h in range(case.num_heads) if h not in wrong]
    if not right:
        text = f"; every query head is wrong (0 .. {case.num_heads - 1})"
    else:
        text = f"; wrong in query heads [{_heads(wrong)}], right in [{_heads(right)}]"
    group = case.num_heads // case.num_kv_heads
    if case.num_kv_heads == 1 or group == 1:
        return text
    atol, rtol = tolerance
    inputs = CaseInputs(case)
    read: dict[int, int] = {}
    for j in range(case.num_kv_heads):
        alt = dense_attention(inputs, token_req, token_pos, kv_head_of=[j] * case.num_heads)
        ok = ((got - alt).abs() <= atol + rtol * alt.abs()).all(dim=0).all(dim=-1)
        for h in wrong:
            if bool(ok[h]) and j != h // group:
                read.setdefault(h, j)
    if not read:
        return text
    pairs = "; ".join(f"query head {h} matches KV head {j} (expected {h // group})"
                      for h, j in sorted(read.items())[:MAX_HEADS_LISTED])
    return (text + f". A GQA head-mapping bug: {pairs}; query head h must read KV head h // {group} "
            f"(num_heads {case.num_heads} // num_kv_heads {case.num_kv_heads}; HF repeat_kv), not e.g. "
            f"h % {case.num_kv_heads}")


__all__ = ["heads_sentence", "poison_sentence"]
