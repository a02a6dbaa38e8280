"""Four planted bugs in copies of the torch_native MLA backend (issue 31): each must fail
the MLA conformance family with a message naming the case.

Loaded by path (``tests/backends/mla/conftest.py`` puts this folder on ``sys.path``) so
``attnplug check buggy_mla:WrongRopeHalf`` works from the tests.
"""

from __future__ import annotations

import torch

from attnplug.backends.mla.torch_native.backend import TorchNativeMLABackend
from attnplug.backends.mla.torch_native.impl import TorchNativeMLAImpl, _softmax_lse


class _RopeHalfImpl(TorchNativeMLAImpl):
    """Writes ``k_pe`` with its two halves swapped (the wrong rope half first)."""

    def write_cache(self, kv_c_normed, k_pe, kv_cache, md):
        h = k_pe.shape[-1] // 2
        super().write_cache(kv_c_normed, torch.cat([k_pe[..., h:], k_pe[..., :h]], -1), kv_cache, md)


class _NoOutputUpProjImpl(TorchNativeMLAImpl):
    """Absorbed decode returns the latent's first ``v_head_dim`` values, never applying W_UV."""

    def up_project_output(self, o_lat, w_uv):
        return o_lat[..., : w_uv.shape[1]]


class _LseSignImpl(TorchNativeMLAImpl):
    """Merges each context chunk with the negated LSE."""

    @staticmethod
    def merge(out_a, lse_a, out_b, lse_b):
        return TorchNativeMLAImpl.merge(out_a, lse_a, out_b, -lse_b)


class _NullBlockImpl(TorchNativeMLAImpl):
    """Decode gathers every block-table column and only masks the scores: rows of the null
    block (past ``seq_len``) reach the weighted sum (0 x NaN)."""

    def forward_mqa(self, q, kv_cache, decode):
        b, bs = decode.num_decodes, kv_cache.shape[1]
        cols = torch.arange(decode.block_table.shape[1] * bs)
        live = cols.unsqueeze(0) < decode.seq_lens[:b].unsqueeze(1).long()
        blocks = decode.block_table[:b].long()[:, cols // bs]
        rows = kv_cache.view(-1, kv_cache.shape[2])[blocks * bs + cols % bs].float()
        p, lse = _softmax_lse(torch.einsum("bnd,bsd->bns", q.float(), rows) * self.scale, live.unsqueeze(1))
        o = torch.einsum("bns,bsl->bnl", p, rows[..., : self.kv_lora_rank])
        return o.to(q.dtype), lse.transpose(0, 1).contiguous()


def _backend(name: str, impl: type) -> type:
    return type(name, (TorchNativeMLABackend,), {
        "get_name": classmethod(lambda cls: name.lower()),
        "get_impl_cls": classmethod(lambda cls: impl),
    })


WrongRopeHalf = _backend("WrongRopeHalf", _RopeHalfImpl)
NoOutputUpProjection = _backend("NoOutputUpProjection", _NoOutputUpProjImpl)
ChunkLseWrongSign = _backend("ChunkLseWrongSign", _LseSignImpl)
ReadsNullBlock = _backend("ReadsNullBlock", _NullBlockImpl)
