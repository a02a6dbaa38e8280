"""The draft-model drafter: a second, smaller model of the same vocabulary proposes ``k``
greedy tokens per decoding request, run through attnplug itself (its own ``ModelRunner``,
so its own ``StepCompiler``, cache groups, builders and KV caches).

How one ``propose`` works for a request with token history ``h`` (prompt + outputs, all
accepted by the target):

1. **Rollback.** The drafter remembers, per request, the tokens whose K/V its cache holds
   (``_DraftState.tokens``: the history it was last given plus the drafts it fed back).
   The valid prefix is the longest common prefix of those tokens and ``h``, capped at
   ``len(h) - 1`` (one token must be computed to get logits). Every position from there on
   is dead: the request re-enters the draft runner as a *new* request with
   ``num_computed_tokens = valid`` over the same blocks (exactly a prefix-cache hit), so the
   draft's rejected tokens are never read, and their slots are overwritten.
2. **Catch-up + first draft.** One step computes ``h[valid:]`` (usually the target's last
   one or two emitted tokens) and samples the first draft greedily.
3. **More drafts.** ``k - 1`` one-token decode steps, each feeding the previous draft.
4. The request leaves the draft runner (``finished_req_ids``); its blocks and
   ``tokens = h + drafts[:-1]`` stay with the drafter for the next step.

Blocks come from the drafter's own free list per cache group; when it runs short the least
recently drafted request's state is dropped (that request recomputes from position 0 next
time; outputs do not change, only cost). ``release(req_id)`` frees a request's state.

The drafts are deterministic (greedy), so the rejection sampler's one-hot draft
distribution (``q(x) = 1``) is exact for random-sampling rows too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
from attnplug.cache_groups.kinds import GroupKind
from attnplug.cache_groups.specs import cdiv
from attnplug.core.errors import ConfigError, MetadataError
from attnplug.runner.execute.cascade import CascadeConfig
from attnplug.runner.execute.model_runner import ModelRunner, RunnerConfig
from attnplug.runner.step.scheduler_output import (CachedRequestData, NewRequestData, SamplingParams,
                                                   SchedulerOutput)

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30)


@dataclass
class _DraftState:
    """One request's state in the drafter: its blocks (per cache group, logical order) and
    the tokens whose K/V they hold (positions ``0 .. len(tokens) - 1``)."""

    blocks: list[list[int]]
    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))


class DraftModelDrafter:
    """Greedy drafts from a draft model, one request at a time.

    Args:
        model: a ``runner.models`` decoder with ``attnplug_backends`` (as
            ``runner/commands/model_loading.build_with_backends`` returns it); its
            ``config.vocab_size`` must be the target's (checked by the caller).
        block_size: the draft cache's manager block size (tokens).
        max_num_seqs: requests whose draft state is kept at once (sizes the pool).
        max_model_len: the target's ``max_model_len`` (no history + drafts is longer).
        device: where the draft model and its caches live.
        seed: the draft runner's sampler seed (greedy drafts do not use it).

    Raises:
        ConfigError: the draft model has Mamba state groups (one state per request could
            not be rolled back to an accepted prefix).
    """

    def __init__(self, model: torch.nn.Module, *, block_size: int, max_num_seqs: int, max_model_len: int,
                 device: torch.device | str = "cpu", seed: int = 0):
        groups = group_layers_by_spec(model.kv_cache_specs(block_size))
        if any(g.kv_cache_spec.kind is GroupKind.MAMBA for g in groups):
            raise ConfigError("--speculative model", "the draft model has Mamba state groups, whose state "
                              "cannot be rolled back to the accepted prefix; use an attention-only draft model")
        self.block_size = block_size
        self.max_model_len = max_model_len
        num_blocks = max_num_seqs * cdiv(max_model_len, block_size) + 1  # block 0: the null block
        self.kv_cache_config = KVCacheConfig(num_blocks, groups)
        backends = [model.attnplug_backends[g.layer_names[0]] for g in groups]
        self.runner = ModelRunner(model, self.kv_cache_config, backends,
                                  RunnerConfig(max_num_reqs=1, max_model_len=max_model_len,
                                               max_num_batched_tokens=max_model_len),
                                  device=device, seed=seed, cascade=CascadeConfig(enabled=False))
        self._free = [list(range(num_blocks - 1, 0, -1)) for _ in groups]
        self._states: OrderedDict[str, _DraftState] = OrderedDict()  # least recently drafted first
        self._calls = 0
        self.num_draft_steps = 0
        """Draft-model steps run (catch-up + decodes), for reports."""
        self.num_recomputed_tokens = 0
        """Tokens the draft model computed (history catch-up and fed-back drafts)."""

    # ---------------------------------------------------------------- state and blocks
    def release(self, req_id: str) -> None:
        """Forget ``req_id`` (its blocks go back to the free lists); unknown ids are ignored."""
        st = self._states.pop(req_id, None)
        if st is not None:
            for free, blocks in zip(self._free, st.blocks):
                free.extend(reversed(blocks))

    def _ensure_blocks(self, req_id: str, st: _DraftState, num_tokens: int) -> None:
        need = cdiv(num_tokens, self.block_size)
        for g, blocks in enumerate(st.blocks):
            while len(blocks) < need:
                while not self._free[g]:
                    victim = next((r for r in self._states if r != req_id), None)
                    if victim is None:
                        raise ConfigError("--speculative", f"the draft cache cannot hold {num_tokens} tokens")
                    self.release(victim)
                blocks.append(self._free[g].pop())

    def valid_prefix(self, req_id: str, history: np.ndarray) -> int:
        """Tokens of ``history`` whose K/V the draft cache holds (the rollback point)."""
        st = self._states.get(req_id)
        if st is None:
            return 0
        n = min(st.tokens.shape[0], history.shape[0] - 1)
        diff = np.flatnonzero(st.tokens[:n] != history[:n])
        return int(diff[0]) if diff.size else n

    # ---------------------------------------------------------------- drafting
    def _step(self, out: SchedulerOutput) -> int:
        self.num_draft_steps += 1
        self.num_recomputed_tokens += out.total_num_scheduled_tokens
        sampled = self.runner.execute_model(out).sampled_token_ids
        (tokens,) = sampled.values()
        return int(tokens[0])

    def propose_one(self, req_id: str, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` greedy draft tokens continuing ``history`` (ints; the request's tokens)."""
        h = np.asarray(history, dtype=np.int64)
        if k <= 0 or h.shape[0] == 0:
            return []
        k = min(k, self.max_model_len - h.shape[0])
        if k <= 0:
            return []
        valid = self.valid_prefix(req_id, h)
        st = self._states.pop(req_id, None) or _DraftState([[] for _ in self._free])
        self._states[req_id] = st  # most recently drafted
        st.tokens = h[:valid]  # rollback: from here on the draft cache is dead
        self._ensure_blocks(req_id, st, h.shape[0] + k - 1)
        self._calls += 1
        iid = f"{req_id}#draft{self._calls}"  # a fresh runner request: num_computed_tokens = valid
        todo = h.shape[0] - valid
        drafts = [self._step(SchedulerOutput(
            [NewRequestData(iid, h.tolist(), tuple(list(b) for b in st.blocks), valid, GREEDY)],
            num_scheduled_tokens={iid: todo}, total_num_scheduled_tokens=todo))]
        for i in range(1, k):
            computed = h.shape[0] + i - 1
            drafts.append(self._step(SchedulerOutput(
                scheduled_cached_reqs=CachedRequestData([iid], [False], [[]], [None], [computed]),
                num_scheduled_tokens={iid: 1}, total_num_scheduled_tokens=1)))
        self.runner.execute_model(SchedulerOutput(finished_req_ids={iid}))
        st.tokens = np.concatenate([h, np.asarray(drafts[:-1], dtype=np.int64)])
        return drafts

    def propose(self, token_histories: Sequence[Sequence[int]], k: int | Sequence[int],
                req_ids: Sequence[str] | None = None) -> list[list[int]]:
        """Drafts per request (``Drafter`` interface).

        Args:
            token_histories: per request, its token ids so far (prompt then outputs).
            k: the most drafts per request (one ``int`` or one per request).
            req_ids: the requests' ids (their draft state is kept under them); without them
                every call starts from an empty cache (correct, but recomputes everything).

        Returns:
            One ``list[int]`` of ``min(k, max_model_len - len(history))`` drafts per request.

        Raises:
            MetadataError: ``k`` negative or of the wrong length, or ``req_ids`` of the wrong length.
        """
        from attnplug.runner.execute.spec_decode.drafter import _per_request_k

        ks = _per_request_k(k, len(token_histories))
        if req_ids is None:
            self._calls += 1
            req_ids = [f"anon{self._calls}-{i}" for i in range(len(token_histories))]
            temporary = True
        else:
            temporary = False
        if len(req_ids) != len(token_histories):
            raise MetadataError(f"{len(req_ids)} req_ids for {len(token_histories)} histories")
        out = [self.propose_one(rid, hist, kk) for rid, hist, kk in zip(req_ids, token_histories, ks)]
        if temporary:
            for rid in req_ids:
                self.release(rid)
        return out
