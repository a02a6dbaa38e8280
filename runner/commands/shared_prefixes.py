"""Prompts with shared prefixes for ``attnplug run --prefix-caching`` and ``parity --prefix-caching``.

The bundled trace has lengths only, so the token ids are made up; this module makes them
share prefixes the way serving traffic does, deterministically from a seed:

* A pool of ``num_system_prompts`` shared system prompts, each of
  ``system_prompt_len`` tokens (a ``default_rng([seed, 1_000_000 + j])`` stream, so a
  system prompt does not depend on the requests).
* Request ``i`` of prompt length ``L``: with probability ``continuation_prob`` (and an
  earlier request to continue) it is a *multi-turn continuation*: the prompt of a random
  earlier request, then fresh tokens, cut to ``L`` (when the earlier prompt is at least
  ``L`` long, the continuation is that prompt's first ``L - 1`` tokens and one fresh one).
  Otherwise it opens with system prompt ``i mod num_system_prompts``'s first
  ``min(system_prompt_len, L - 1)`` tokens, followed by fresh tokens (its own
  ``default_rng([seed, i])`` stream, as ``traces.make_prompts``).

Every prompt keeps its trace length, and at least its last token is its own, so a request
never hits its whole prompt. The choices come from one ``default_rng([seed, 2_000_000])``
stream, so the prompts depend only on the seed and the trace's lengths.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

SYSTEM_PROMPTS = 1
"""``attnplug run --system-prompts`` default: shared system prompts in the pool."""
SYSTEM_PROMPT_LEN = 256
"""``attnplug run --system-prompt-len`` default: tokens per system prompt."""

from attnplug.core.errors import AttnplugError


def make_shared_prefix_prompts(prompt_lens: Sequence[int], vocab_size: int, seed: int = 0, *,
                               num_system_prompts: int = 4, system_prompt_len: int = 64,
                               continuation_prob: float = 0.3) -> list[list[int]]:
    """One prompt per length (see the module docstring).

    Args:
        prompt_lens: per request, its prompt length (tokens, ``>= 1``).
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        seed: ``>= 0``.
        num_system_prompts: size of the shared pool, ``>= 1``.
        system_prompt_len: tokens per system prompt, ``>= 1``.
        continuation_prob: share of requests that continue an earlier one, in ``[0, 1]``.

    Returns:
        Lists of Python ints, ``len(result[i]) == prompt_lens[i]``.

    Raises:
        AttnplugError: an argument out of range.
    """
    if vocab_size < 1 or seed < 0 or num_system_prompts < 1 or system_prompt_len < 1 \
            or not 0.0 <= continuation_prob <= 1.0 or any(int(n) < 1 for n in prompt_lens):
        raise AttnplugError(
            f"shared prefixes: need vocab_size >= 1 ({vocab_size}), seed >= 0 ({seed}), num_system_prompts >= 1 "
            f"({num_system_prompts}), system_prompt_len >= 1 ({system_prompt_len}), continuation_prob in [0, 1] "
            f"({continuation_prob}) and every prompt length >= 1")
    pool = [np.random.default_rng([seed, 1_000_000 + j]).integers(0, vocab_size, size=system_prompt_len).tolist()
            for j in range(num_system_prompts)]
    choose = np.random.default_rng([seed, 2_000_000])
    out: list[list[int]] = []
    for i, n in enumerate(int(x) for x in prompt_lens):
        own = np.random.default_rng([seed, i]).integers(0, vocab_size, size=n).tolist()
        if out and choose.random() < continuation_prob:
            head = out[int(choose.integers(0, len(out)))][:n - 1]
        else:
            head = pool[i % num_system_prompts][:n - 1]
        out.append(head + own[len(head):])
    return out

