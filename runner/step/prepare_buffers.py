"""``PrepareBuffers``: the persistent host/device buffers stage 3 fills each step — the
hand-off between ``InputPreparer`` (``prepare.py``, which owns them and wraps their
prefixes in ``StepInputs``) and the step's kernels (``kernels.py``, which write them).
Data only; each field gives its shape and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from attnplug.cache_groups.buffers import CpuGpuBuffer


@dataclass
class PrepareBuffers:
    """The persistent buffers stage 3 fills each step (``M`` = ``max_num_reqs``, ``T`` =
    ``max_num_batched_tokens``); ``InputPreparer`` owns them, the kernels write them."""

    query_start_loc: CpuGpuBuffer
    """``[M + 1]`` ``int32``."""
    positions: CpuGpuBuffer
    """``[T]`` ``int64``."""
    input_ids: CpuGpuBuffer
    """``[T]`` ``int32``."""
    seq_lens: CpuGpuBuffer
    """``[M]`` ``int32``."""
    logits_indices: CpuGpuBuffer
    """``[M]`` ``int64``."""
    req_indices: np.ndarray
    """``[T]`` ``int64`` the row of each token."""
    discard: np.ndarray
    """``[M]`` ``bool`` the row's logits are discarded (``seq_lens < num_tokens``)."""
    is_prefilling: np.ndarray
    """``[M]`` ``bool`` ``num_computed_tokens < num_prompt_tokens``."""
    arange: np.ndarray
    """``[max(T, M) + 1]`` ``int64`` ``0, 1, 2, ...`` (scratch of the numpy kernels)."""
    flat_idx: np.ndarray
    """``[T]`` ``int64`` scratch: flat indices into the token table."""
    row_starts: np.ndarray
    """``[M]`` ``int64`` ``row * max_model_len``."""
    spec_logits_indices: CpuGpuBuffer
    """``[T]`` ``int64`` ``SpecDecodeMetadata.logits_indices`` (``runner/step/spec_metadata.py``)."""
    spec_target: CpuGpuBuffer
    """``[T]`` ``int64`` ``target_logits_indices``."""
    spec_bonus: CpuGpuBuffer
    """``[M]`` ``int64`` ``bonus_logits_indices``."""
    spec_cu: CpuGpuBuffer
    """``[M]`` ``int64`` ``cu_num_draft_tokens``."""
    spec_draft_ids: CpuGpuBuffer
    """``[T]`` ``int64`` ``draft_token_ids``."""
    patch_dest: np.ndarray
    """``[M]`` ``int64`` asynchronous patch: token indices of this step (``placeholders.py``)."""
    patch_src: np.ndarray
    """``[M]`` ``int64`` asynchronous patch: indices into the previous step's sampled tensor."""
    patch_steps: np.ndarray
    """``[2]`` ``int64`` asynchronous patch: how many steps ``prepare_patched`` patched by
    one slice copy (rows kept their order: ``dest == src == arange(k)``) and by a scatter
    (``StepCompiler.patch_counts``)."""
    spec_views: dict = field(default_factory=dict)
    """On a CPU device (the buffers are their own device tensors): ``(kept rows, drafts)`` →
    the five ``spec_*`` prefix views ``spec_decode_metadata`` hands out (made once per shape)."""

    @classmethod
    def allocate(cls, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int,
                 device: torch.device | str) -> "PrepareBuffers":
        M, T = max_num_reqs, max_num_batched_tokens
        i64 = lambda n: CpuGpuBuffer((n,), torch.int64, device)  # noqa: E731
        return cls(CpuGpuBuffer((M + 1,), torch.int32, device), i64(T),
                   CpuGpuBuffer((T,), torch.int32, device), CpuGpuBuffer((M,), torch.int32, device),
                   i64(M), np.zeros(T, np.int64), np.zeros(M, bool),
                   np.zeros(M, bool), np.arange(max(T, M) + 1, dtype=np.int64), np.zeros(T, np.int64),
                   np.arange(M, dtype=np.int64) * max_model_len, i64(T), i64(T), i64(M), i64(M), i64(T),
                   np.zeros(M, np.int64), np.zeros(M, np.int64), np.zeros(2, np.int64))


__all__ = ["PrepareBuffers"]
