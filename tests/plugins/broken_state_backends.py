"""mamba2_torch and gdn_torch with one bug each of the kinds the field reported on hybrid (state)
models (vllm#53912, vllm#55766, sglang#31474: prefix caching or speculative decoding with
recurrent state silently producing wrong text or NaN). The hybrid-state family must fail each,
naming the case (tests/plugins/test_state_conformance.py)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from attnplug.backends.mamba2 import Mamba2Backend
from attnplug.backends.mamba2.impl import Mamba2Impl
from attnplug.backends.mamba2.metadata import Mamba2MetadataBuilder
from attnplug.backends.state.gdn.backend import GDNTorchBackend
from attnplug.backends.state.gdn.impl import GDNTorchImpl
from attnplug.backends.state.gdn.metadata import GDNMetadataBuilder


class _ServesDraftsAsPrefill:
    """A builder mixin: serves a verifying row as a plain prefill chunk: the own slot ends at
    the state after the last draft, the scratch slots are never written (a rejected draft's
    state is kept)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return super().build(common_prefix_len, common_attn_metadata.replace(num_draft_tokens_cpu=None), fast_build)


class _UnseenSlotIsFresh:
    """An impl mixin: treats a slot it has not seen before as a new request's (zeroes it):
    wrong ``has_initial_state`` for a prefix hit, whose restored slot is new but holds a state."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: set[int] = set()

    def _fresh_if_unseen(self, md):
        """``md`` with every row whose slot this impl has not seen before among ``fresh_rows``."""
        slots = md.state_indices[:md.num_reqs].tolist()
        new = [i for i, s in enumerate(slots) if s not in self.seen]
        self.seen.update(slots)
        rows = sorted(set(md.fresh_rows.tolist()) | set(new))
        return dataclasses.replace(md, fresh_rows=torch.tensor(rows, dtype=torch.int64, device=md.fresh_rows.device))


def _pad_row_into_slot0(state, conv_input: torch.Tensor, md, output: torch.Tensor) -> None:
    """Maps padded rows' ``PAD_SLOT_ID`` to slot 0 (``clamp(min=0)``) and writes their conv
    input there: a step with padded tokens writes the null slot."""
    if output.shape[0] > md.num_actual_tokens:
        state.conv_state[0] = conv_input[-1, :, None].to(state.conv_state.dtype)


def _backend(base: type, name: str, impl: type, builder: type) -> type:
    """``base`` registered as ``name``, with ``impl`` and ``builder``."""
    return type(name, (base,), {"get_name": classmethod(lambda cls: name),
                                "get_impl_cls": classmethod(lambda cls: impl),
                                "get_builder_cls": classmethod(lambda cls: builder)})


class _IgnoresDraftsBuilder(_ServesDraftsAsPrefill, Mamba2MetadataBuilder):
    """Verifying rows served as plain prefill chunks (:class:`_ServesDraftsAsPrefill`)."""


class _ConvNotCarriedImpl(Mamba2Impl):
    """A prefill chunk that continues a request starts its causal conv1d from zeros (the SSM
    state is carried, the conv state is not)."""

    def _prefill(self, xbc, dt, state, slots, params, md):
        state.conv_state.index_fill_(0, slots, 0)
        return super()._prefill(xbc, dt, state, slots, params, md)


class _HitIsFreshImpl(_UnseenSlotIsFresh, Mamba2Impl):
    """A slot not seen before is zeroed (:class:`_UnseenSlotIsFresh`)."""

    def forward(self, layer, hidden_states_B_C, dt, state, attn_metadata, output):
        return super().forward(layer, hidden_states_B_C, dt, state, self._fresh_if_unseen(attn_metadata), output)


class _PadRowSlot0Impl(Mamba2Impl):
    """A padded row's conv input written into the null slot 0 (:func:`_pad_row_into_slot0`)."""

    def forward(self, layer, hidden_states_B_C, dt, state, attn_metadata, output):
        super().forward(layer, hidden_states_B_C, dt, state, attn_metadata, output)
        _pad_row_into_slot0(state, hidden_states_B_C, attn_metadata, output)
        return output


_mamba = functools.partial(_backend, Mamba2Backend, impl=Mamba2Impl, builder=Mamba2MetadataBuilder)
RejectedDraftKept = _mamba("rejected_draft_kept", builder=_IgnoresDraftsBuilder)
ConvNotCarried = _mamba("conv_not_carried", impl=_ConvNotCarriedImpl)
HitNotInitial = _mamba("hit_not_initial", impl=_HitIsFreshImpl)
PadRowWritesSlot0 = _mamba("pad_row_writes_slot0", impl=_PadRowSlot0Impl)


# --- the same bugs in gdn_torch ---------------------------------------------------------------
class _GDNIgnoresDraftsBuilder(_ServesDraftsAsPrefill, GDNMetadataBuilder):
    """As :class:`_IgnoresDraftsBuilder`: verifying rows served as plain prefill chunks."""


class _GDNConvNotCarriedImpl(GDNTorchImpl):
    """A continuing prefill chunk starts its causal conv1d from zeros (the recurrent state is carried)."""

    def _prefill(self, qkv, a, b, state, slots, weight, bias, gates, md):
        state.conv_state.index_fill_(0, slots, 0)
        return super()._prefill(qkv, a, b, state, slots, weight, bias, gates, md)


class _GDNHitIsFreshImpl(_UnseenSlotIsFresh, GDNTorchImpl):
    """As :class:`_HitIsFreshImpl`: a slot not seen before is zeroed (a prefix hit's restored state lost)."""

    def forward(self, layer, mixed_qkv, a, b, state, attn_metadata, output):
        return super().forward(layer, mixed_qkv, a, b, state, self._fresh_if_unseen(attn_metadata), output)


class _GDNPadRowSlot0Impl(GDNTorchImpl):
    """As :class:`_PadRowSlot0Impl`: a padded row's conv input written into the null slot 0."""

    def forward(self, layer, mixed_qkv, a, b, state, attn_metadata, output):
        super().forward(layer, mixed_qkv, a, b, state, attn_metadata, output)
        _pad_row_into_slot0(state, mixed_qkv, attn_metadata, output)
        return output


_gdn = functools.partial(_backend, GDNTorchBackend, impl=GDNTorchImpl, builder=GDNMetadataBuilder)
GDNRejectedDraftKept = _gdn("gdn_rejected_draft_kept", builder=_GDNIgnoresDraftsBuilder)
GDNConvNotCarried = _gdn("gdn_conv_not_carried", impl=_GDNConvNotCarriedImpl)
GDNHitNotInitial = _gdn("gdn_hit_not_initial", impl=_GDNHitIsFreshImpl)
GDNPadRowWritesSlot0 = _gdn("gdn_pad_row_writes_slot0", impl=_GDNPadRowSlot0Impl)
