"""mamba2_torch and gdn_torch with one bug each of the kinds the field reported on hybrid (state)
models (vllm#53912, vllm#55766, sglang#31474: prefix caching or speculative decoding with
recurrent state silently producing wrong text or NaN). The hybrid-state family must fail each,
naming the case (tests/plugins/test_state_conformance.py)."""

from __future__ import annotations

import dataclasses

import torch

from attnplug.backends.mamba2 import Mamba2Backend
from attnplug.backends.mamba2.impl import Mamba2Impl
from attnplug.backends.mamba2.metadata import Mamba2MetadataBuilder
from attnplug.backends.state.gdn.backend import GDNTorchBackend
from attnplug.backends.state.gdn.impl import GDNTorchImpl
from attnplug.backends.state.gdn.metadata import GDNMetadataBuilder


class _IgnoresDraftsBuilder(Mamba2MetadataBuilder):
    """Serves a verifying row as a plain prefill chunk: the own slot ends at the state after
    the last draft, the scratch slots are never written (a rejected draft's state is kept)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return super().build(common_prefix_len, common_attn_metadata.replace(num_draft_tokens_cpu=None), fast_build)


class _ConvNotCarriedImpl(Mamba2Impl):
    """A prefill chunk that continues a request starts its causal conv1d from zeros (the SSM
    state is carried, the conv state is not)."""

    def _prefill(self, xbc, dt, state, slots, params, md):
        state.conv_state.index_fill_(0, slots, 0)
        return super()._prefill(xbc, dt, state, slots, params, md)


class _HitIsFreshImpl(Mamba2Impl):
    """Treats a slot it has not seen before as a new request's (zeroes it): wrong
    ``has_initial_state`` for a prefix hit, whose restored slot is new but holds a state."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: set[int] = set()

    def forward(self, layer, hidden_states_B_C, dt, state, attn_metadata, output):
        md = attn_metadata
        slots = md.state_indices[:md.num_reqs].tolist()
        new = [i for i, s in enumerate(slots) if s not in self.seen]
        self.seen.update(slots)
        rows = sorted(set(md.fresh_rows.tolist()) | set(new))
        md = dataclasses.replace(md, fresh_rows=torch.tensor(rows, dtype=torch.int64, device=md.fresh_rows.device))
        return super().forward(layer, hidden_states_B_C, dt, state, md, output)


class _PadRowSlot0Impl(Mamba2Impl):
    """Maps padded rows' ``PAD_SLOT_ID`` to slot 0 (``clamp(min=0)``) and writes their state
    there: a step with padded tokens writes the null slot."""

    def forward(self, layer, hidden_states_B_C, dt, state, attn_metadata, output):
        super().forward(layer, hidden_states_B_C, dt, state, attn_metadata, output)
        if output.shape[0] > attn_metadata.num_actual_tokens:
            state.conv_state[0] = hidden_states_B_C[-1, :, None].to(state.conv_state.dtype)
        return output


def _mamba(name: str, impl=Mamba2Impl, builder=Mamba2MetadataBuilder) -> type:
    return type(name, (Mamba2Backend,), {"get_name": classmethod(lambda cls: name),
                                         "get_impl_cls": classmethod(lambda cls: impl),
                                         "get_builder_cls": classmethod(lambda cls: builder)})


RejectedDraftKept = _mamba("rejected_draft_kept", builder=_IgnoresDraftsBuilder)
ConvNotCarried = _mamba("conv_not_carried", impl=_ConvNotCarriedImpl)
HitNotInitial = _mamba("hit_not_initial", impl=_HitIsFreshImpl)
PadRowWritesSlot0 = _mamba("pad_row_writes_slot0", impl=_PadRowSlot0Impl)


# --- the same bugs in gdn_torch ---------------------------------------------------------------
class _GDNIgnoresDraftsBuilder(GDNMetadataBuilder):
    """As :class:`_IgnoresDraftsBuilder`: verifying rows served as plain prefill chunks."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return super().build(common_prefix_len, common_attn_metadata.replace(num_draft_tokens_cpu=None), fast_build)


class _GDNConvNotCarriedImpl(GDNTorchImpl):
    """A continuing prefill chunk starts its causal conv1d from zeros (the recurrent state is carried)."""

    def _prefill(self, qkv, a, b, state, slots, weight, bias, gates, md):
        state.conv_state.index_fill_(0, slots, 0)
        return super()._prefill(qkv, a, b, state, slots, weight, bias, gates, md)


class _GDNHitIsFreshImpl(GDNTorchImpl):
    """As :class:`_HitIsFreshImpl`: a slot not seen before is zeroed (a prefix hit's restored state lost)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: set[int] = set()

    def forward(self, layer, mixed_qkv, a, b, state, attn_metadata, output):
        md = attn_metadata
        slots = md.state_indices[:md.num_reqs].tolist()
        new = [i for i, s in enumerate(slots) if s not in self.seen]
        self.seen.update(slots)
        rows = sorted(set(md.fresh_rows.tolist()) | set(new))
        md = dataclasses.replace(md, fresh_rows=torch.tensor(rows, dtype=torch.int64, device=md.fresh_rows.device))
        return super().forward(layer, mixed_qkv, a, b, state, md, output)


class _GDNPadRowSlot0Impl(GDNTorchImpl):
    """As :class:`_PadRowSlot0Impl`: a padded row's conv input written into the null slot 0."""

    def forward(self, layer, mixed_qkv, a, b, state, attn_metadata, output):
        super().forward(layer, mixed_qkv, a, b, state, attn_metadata, output)
        if output.shape[0] > attn_metadata.num_actual_tokens:
            state.conv_state[0] = mixed_qkv[-1, :, None].to(state.conv_state.dtype)
        return output


def _gdn(name: str, impl=GDNTorchImpl, builder=GDNMetadataBuilder) -> type:
    return type(name, (GDNTorchBackend,), {"get_name": classmethod(lambda cls: name),
                                           "get_impl_cls": classmethod(lambda cls: impl),
                                           "get_builder_cls": classmethod(lambda cls: builder)})


GDNRejectedDraftKept = _gdn("gdn_rejected_draft_kept", builder=_GDNIgnoresDraftsBuilder)
GDNConvNotCarried = _gdn("gdn_conv_not_carried", impl=_GDNConvNotCarriedImpl)
GDNHitNotInitial = _gdn("gdn_hit_not_initial", impl=_GDNHitIsFreshImpl)
GDNPadRowWritesSlot0 = _gdn("gdn_pad_row_writes_slot0", impl=_GDNPadRowSlot0Impl)
