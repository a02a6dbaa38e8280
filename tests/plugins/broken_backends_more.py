"""More deliberately broken backends, for the NaN-poison and silent no-write checks.

Imported by module path (``--attnplug-backend broken_backends_more:Name``) from
``test_conformance_poison.py``. ``GatherReader`` is a small, self-contained backend (its
own metadata and impl, the shape of a third-party one) that writes K/V correctly and
attends with a correct mask, but gathers more keys than the queries can see:

* ``ReadsFromKeyZero``: every key ``0 .. seq_len - 1``, so in a sliding-window case the
  freed blocks (null in the block table) are read and masked out;
* ``ReadsWholeRow``: every column of the block-table row, so the null block padding the
  row past the request's blocks is read and masked out.

* ``ShortWindow``: a decode reads ``cdiv(W, B)`` blocks from its window's first block,
  one too few when the window straddles ``cdiv(W - 1, B) + 1`` blocks (a relation of
  window and block size the suite must vary).

* ``ReadsPastSeqLen``: the causal mask is off by one, so each request's last query attends
  to the unwritten slot after its last key (the finite poison: the failure must say it
  read keys outside the visible range);
* ``ModuloHeads``: GQA head h reads KV head ``h % num_kv_heads`` (``repeat`` for
  ``repeat_interleave``): the failure must name the wrong and the right heads.

Masked reads of NaN still give NaN (``0 * NaN``), so both must fail naming the null block.
``WritesIntoACopy`` is torch_native whose K/V write lands in a ``reshape`` copy of the
strided cache view: the step writes none of its slots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from attnplug.backends.torch_native import TorchNativeAttentionImpl, TorchNativeBackend
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import AttentionImpl, AttentionMetadataBuilder


@dataclass(frozen=True)
class GatherMetadata:
    num_actual_tokens: int
    query_start_loc: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class GatherBuilder(AttentionMetadataBuilder):
    supports_update_block_table = False

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cm = common_attn_metadata
        n = cm.num_reqs
        return GatherMetadata(cm.num_actual_tokens, tuple(cm.query_start_loc_cpu[:n + 1].tolist()),
                              tuple(cm.seq_lens_cpu[:n].tolist()), cm.block_table_tensor[:n],
                              cm.slot_mapping[:cm.num_actual_tokens])


class GatherImpl(AttentionImpl):
    whole_row = False
    lookahead = 0
    """Keys visible past the query's position (0: causal)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        md = attn_metadata
        k_cache, v_cache = TorchNativeBackend.split_kv_cache(kv_cache)   # [blocks, bs, H_kv, D] views
        bs = k_cache.shape[1]
        real = torch.nonzero(md.slot_mapping != PAD_SLOT_ID).flatten()
        slots = md.slot_mapping[real].long()
        k_cache[slots // bs, slots % bs] = key[real].to(k_cache.dtype)
        v_cache[slots // bs, slots % bs] = value[real].to(v_cache.dtype)
        group = self.num_heads // self.num_kv_heads
        for i, seq_len in enumerate(md.seq_lens):
            lo, hi = md.query_start_loc[i], md.query_start_loc[i + 1]
            pos = self.key_positions(seq_len, hi - lo, bs, md.block_table.shape[1])
            ids = md.block_table[i].long()[pos // bs]
            k = self.expand_kv(k_cache[ids, pos % bs].float(), group)   # [keys, H, D]
            v = self.expand_kv(v_cache[ids, pos % bs].float(), group)
            q_pos = torch.arange(seq_len - (hi - lo), seq_len)[:, None]
            visible = (pos[None, :] <= q_pos + self.lookahead) & (pos[None, :] < seq_len + self.lookahead)
            if self.sliding_window is not None:
                visible &= pos[None, :] > q_pos - self.sliding_window
            logits = torch.einsum("qhd,khd->hqk", query[lo:hi].float(), k) * self.scale
            if self.logits_soft_cap is not None:
                logits = self.logits_soft_cap * torch.tanh(logits / self.logits_soft_cap)
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            output[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(output.dtype)
        return output

    def key_positions(self, seq_len: int, query_len: int, bs: int, row_blocks: int) -> torch.Tensor:
        """The key positions gathered for one request (``[n_keys]`` int64)."""
        return torch.arange(row_blocks * bs if self.whole_row else seq_len + self.lookahead)

    def expand_kv(self, x: torch.Tensor, group: int) -> torch.Tensor:
        """``[keys, num_kv_heads, D]`` -> ``[keys, num_heads, D]``: query head h reads KV head h // group."""
        return x.repeat_interleave(group, dim=1)


class LookaheadImpl(GatherImpl):
    """Causal mask off by one: the query at position p also sees key p + 1; the last query
    of a request reads the unwritten slot after its last key."""

    lookahead = 1


class ModuloHeadsImpl(GatherImpl):
    """GQA with ``repeat`` for ``repeat_interleave``: query head h reads KV head
    ``h % num_kv_heads`` instead of ``h // group``."""

    def expand_kv(self, x, group):
        return x.repeat(1, group, 1)


class WholeRowImpl(GatherImpl):
    whole_row = True


class ShortWindowImpl(GatherImpl):
    """Sliding window, decodes: gathers ``cdiv(W, B)`` blocks from the window's first block
    (a decode kernel's "blocks per window" bound). A window that does not start at a block
    boundary spans ``cdiv(W - 1, B) + 1`` blocks: the newest keys, the query's own
    included, are never seen. Prefill chunks are right."""

    def key_positions(self, seq_len, query_len, bs, row_blocks):
        if self.sliding_window is None:
            return super().key_positions(seq_len, query_len, bs, row_blocks)
        first = max(0, seq_len - query_len - self.sliding_window + 1) // bs   # the window's first block
        if query_len != 1:
            return torch.arange(first * bs, seq_len)
        n_blocks = -(-self.sliding_window // bs)
        return torch.arange(first * bs, min(seq_len, (first + n_blocks) * bs))


class _NoWriteImpl(TorchNativeAttentionImpl):
    """Writes K/V into ``kv_cache[:, 0].reshape(...)``: a copy of the strided view."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        md = attn_metadata
        flat_k = kv_cache[:, 0].reshape(-1, self.num_kv_heads, self.head_size)   # copies: strided view
        flat_v = kv_cache[:, 1].reshape(-1, self.num_kv_heads, self.head_size)
        flat_k[md.write_slots] = key[md.write_token_indices].to(flat_k.dtype)
        flat_v[md.write_slots] = value[md.write_token_indices].to(flat_v.dtype)
        none = md.write_slots[:0]
        return super().forward(layer, query, key, value, kv_cache,
                               dataclasses.replace(md, write_slots=none, write_token_indices=none), output)


def _backend(name: str, builder, impl) -> type:
    return type(name, (TorchNativeBackend,), {"get_name": classmethod(lambda cls: name),
                                              "get_builder_cls": classmethod(lambda cls: builder),
                                              "get_impl_cls": classmethod(lambda cls: impl)})


ReadsFromKeyZero = _backend("reads_from_key_zero", GatherBuilder, GatherImpl)
ReadsWholeRow = _backend("reads_whole_row", GatherBuilder, WholeRowImpl)
ShortWindow = _backend("short_window", GatherBuilder, ShortWindowImpl)
ReadsPastSeqLen = _backend("reads_past_seq_len", GatherBuilder, LookaheadImpl)
ModuloHeads = _backend("modulo_heads", GatherBuilder, ModuloHeadsImpl)
WritesIntoACopy = _backend("writes_into_a_copy", TorchNativeBackend.get_builder_cls(), _NoWriteImpl)


# --- Mamba (state) backends: mamba2_torch with one realistic bug each -----------------------
from attnplug.backends.mamba2 import Mamba2Backend  # noqa: E402
from attnplug.backends.mamba2.impl import Mamba2Impl  # noqa: E402


class _NoZeroImpl(Mamba2Impl):
    """Never zeroes a fresh request's slot: reads the previous owner's stale state."""

    def forward(self, layer, hidden_states_B_C, dt, state, attn_metadata, output):
        md = dataclasses.replace(attn_metadata, fresh_rows=attn_metadata.fresh_rows[:0])
        return super().forward(layer, hidden_states_B_C, dt, state, md, output)


class _ForgetsStateImpl(Mamba2Impl):
    """Zeroes every row's slot: the state is not carried across steps."""

    def forward(self, layer, hidden_states_B_C, dt, state, attn_metadata, output):
        md = attn_metadata
        md = dataclasses.replace(md, fresh_rows=torch.arange(md.num_reqs, device=md.fresh_rows.device))
        return super().forward(layer, hidden_states_B_C, dt, state, md, output)


class _PadSlotImpl(Mamba2Impl):
    """Also writes a padded row's state through PAD_SLOT_ID (-1): the pool's last slot."""

    def forward(self, layer, hidden_states_B_C, dt, state, attn_metadata, output):
        super().forward(layer, hidden_states_B_C, dt, state, attn_metadata, output)
        state.ssm_state[PAD_SLOT_ID] = 0.0
        return output


def _mamba(name: str, impl) -> type:
    return type(name, (Mamba2Backend,), {"get_name": classmethod(lambda cls: name),
                                         "get_impl_cls": classmethod(lambda cls: impl)})


StateNotZeroed = _mamba("state_not_zeroed", _NoZeroImpl)
StateForgotten = _mamba("state_forgotten", _ForgetsStateImpl)
StateWritesPadSlot = _mamba("state_writes_pad_slot", _PadSlotImpl)


class OtherCacheKind(TorchNativeBackend):
    """Serves a cache kind the suite has no cases for: ``attnplug check`` refuses it (exit 6)."""

    kv_cache_kind = "linear_attention"

    @classmethod
    def get_name(cls):
        return "other_cache_kind"
