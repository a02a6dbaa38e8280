"""``FlashMLASparseImpl``: ``forward_sparse`` lowered to ``flash_mla_sparse_fwd``.

Per call: heads zero-padded to a multiple of 64 (``HEAD_MULTIPLE``); the latent cache viewed
as ``[num_slots, 1, L + R]``; the slots as ``int32`` ``[T, 1, K]`` (``-1`` kept: FlashMLA
skips it); the output's first ``num_heads`` heads kept and its base-2 LSE turned into the
contract's natural log, ``[N, T]``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from attnplug.backends.sparse.common.consumer import SparseMLACommonImpl
from attnplug.backends.sparse.flashmla.kernels import load_flash_mla_sparse
from attnplug.core.errors import BackendUnsupportedError

HEAD_MULTIPLE = 64
"""FlashMLA's sparse kernel takes ``h_q`` in multiples of 64."""


class FlashMLASparseImpl(SparseMLACommonImpl):
    """The FlashMLA sparse lowering (see the module docstring)."""

    @classmethod
    def load_kernel(cls) -> Callable:
        fn, why = load_flash_mla_sparse()
        if fn is None:
            raise BackendUnsupportedError("flashmla_sparse", [why])
        return fn

    def forward_sparse(self, q, kv_cache, slots):
        t, n, width = q.shape
        pad = -n % HEAD_MULTIPLE
        q_in = torch.cat([q, q.new_zeros(t, pad, width)], dim=1) if pad else q
        out, _max_logits, lse2 = self.load_kernel()(
            q_in.contiguous(), kv_cache.view(-1, 1, width), slots.to(torch.int32).unsqueeze(1).contiguous(),
            self.scale, self.kv_lora_rank)
        lse = lse2[:, :n].float().masked_fill(lse2[:, :n] == float("inf"), float("-inf"))  # no valid index
        lse = (lse * math.log(2.0)).transpose(0, 1).contiguous()
        return out[:, :n], lse
