"""After verification: the state at the accepted length becomes each request's state.

In a step with drafts a state backend leaves, for a verifying row with ``d`` drafts, the
state after its first ``j + 1`` tokens in block-table column ``j`` of every state group
(``j = 0 .. d``; column 0 is the request's own slot, the others its scratch slots:
``KVCacheConfig.state_slots_per_request = 1 + k``). The rejection sampler then emits
``a + 1`` tokens (``a`` accepted drafts); :func:`commit_draft_states` copies column ``a``
into column 0 for every row with ``a > 0`` (``a == 0``: column 0 already holds it). The
states of rejected drafts stay in scratch slots, which no later step reads as an initial
state and the next verification overwrites: they leave no trace.
docs/speculative-decoding.md, "State groups".
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from attnplug.cache_groups.buffers import upload
from attnplug.cache_groups.kinds import GroupKind
from attnplug.runner.step.spec_apply import draft_state_copies


@torch.inference_mode()
def commit_draft_states(runner, rows: np.ndarray, tokens: Sequence[Sequence[int]]) -> int:
    """Copy each verifying row's state at its accepted length into its own slot, in every
    layer of every state group of ``runner`` (a ``ModelRunner``); before the verified
    tokens are appended (the rows are this step's). Returns the rows copied."""
    groups = [g for g, grp in enumerate(runner.kv_cache_config.groups) if grp.kv_cache_spec.kind is GroupKind.MAMBA]
    if not groups:
        return 0
    bt = runner.compiler.input_batch.block_table
    copies = draft_state_copies([bt[g].block_table_np for g in groups], rows, tokens)
    n = 0
    for g, (src, dst) in zip(groups, copies):
        if not src.shape[0]:
            continue
        n = src.shape[0]
        on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # one upload per device, not per layer
        for name in runner.kv_cache_config.groups[g].layer_names:
            cache = runner.kv_caches[name]
            for t in tuple(cache):  # every tensor the state spec declares (core/state.py)
                if t.device not in on_device:
                    on_device[t.device] = upload(src, t.device), upload(dst, t.device)
                s, d = on_device[t.device]
                t.index_copy_(0, d, t.index_select(0, s))
    return n
