"""Admission checks of ``Scheduler.add_request``: a request that can never run is refused.

Separate from the scheduler so that the rules read in one place: the prompt, the sampling
limits, the token budget without chunked prefill, and whether the request fits each cache
group's pool even alone.
"""

from __future__ import annotations

from typing import Container, Sequence

from attnplug.cache_groups.block_pool import KVCacheManager
from attnplug.core.errors import InvalidRequestError
from attnplug.runner.serve.scheduler_config import SchedulerConfig
from attnplug.runner.step.scheduler_output import SamplingParams


def check_new_request(cfg: SchedulerConfig, kv_cache_manager: KVCacheManager, known: Container[str],
                      req_id: str, prompt_token_ids: Sequence[int], sp: SamplingParams) -> list[int]:
    """The checks of a new request (``known``: the ids already used).

    Returns:
        The prompt as a list of ints.

    Raises:
        InvalidRequestError: a non-str, empty or duplicate id, an empty or too long prompt, a negative
            token id, ``max_tokens < 1``, ``stop_token_ids`` that is not a tuple of token
            ids, a prompt that can never be scheduled (longer than the budget with chunked
            prefill off) or a request that cannot fit in some group's pool even alone.
    """
    if not isinstance(req_id, str) or not req_id:
        raise InvalidRequestError(str(req_id), "req_id must be a non-empty str")
    if req_id in known:
        raise InvalidRequestError(req_id, "duplicate request id; every request needs a new id")
    prompt = [int(t) for t in prompt_token_ids]
    n = len(prompt)
    if n == 0:
        raise InvalidRequestError(req_id, "empty prompt; a request needs at least one token")
    if n >= cfg.max_model_len:
        raise InvalidRequestError(
            req_id, f"prompt has {n} tokens but max_model_len={cfg.max_model_len} leaves no "
            "room for an output token; shorten the prompt or raise max_model_len")
    if min(prompt) < 0:
        raise InvalidRequestError(req_id, f"negative token id {min(prompt)} in the prompt")
    if not isinstance(sp.max_tokens, int) or sp.max_tokens < 1:
        raise InvalidRequestError(req_id, f"sampling_params.max_tokens must be >= 1, got {sp.max_tokens!r}")
    stops = sp.stop_token_ids
    if not isinstance(stops, tuple) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
        raise InvalidRequestError(req_id, f"sampling_params.stop_token_ids must be a tuple of token ids, "
                                          f"got {stops!r}")
    if not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
        raise InvalidRequestError(
            req_id, f"prompt has {n} tokens > max_num_batched_tokens={cfg.max_num_batched_tokens} "
            "with chunked prefill disabled, so it can never be scheduled; enable chunked prefill "
            "or raise max_num_batched_tokens")
    # The last sampled token is never computed: at most this many tokens get K/V.
    max_cached = min(n + sp.max_tokens, cfg.max_model_len) - 1
    need = kv_cache_manager.max_blocks_per_request(max_cached, cfg.max_num_batched_tokens)
    cap = kv_cache_manager.capacity_per_group
    for g, (nb, c) in enumerate(zip(need, cap)):
        if nb > c:
            raise InvalidRequestError(
                req_id, f"needs up to {nb} blocks in cache group {g} but its pool has only {c} "
                "(num_blocks - 1), so it could never finish; raise num_blocks or lower max_tokens")
    return prompt
