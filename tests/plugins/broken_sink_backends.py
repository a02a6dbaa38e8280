"""Backends with planted attention-sink bugs: the conformance suite's sink cases must fail each.

Copies of ``torch_native`` (``--attnplug-backend broken_sink_backends:Name``) that declare
``supports_sink()`` but get the sinks wrong:

* ``DropsSinks``: accepts ``sinks`` and never uses it (the silent drop of issue 33);
* ``SinkInNumerator``: adds the sink's ``exp(s)`` to every visible key's numerator as well
  as to the denominator (rows then sum to more than 1);
* ``SinkWithoutScale``: compares the sink with the *unscaled* logits ``q . k`` (the sink
  must sit beside the logits after the softmax scale).
"""

from __future__ import annotations

import contextlib

import torch

import attnplug.backends.torch_native.attention as tn_attention
from attnplug.backends.torch_native import TorchNativeAttentionImpl, TorchNativeBackend


def _backend(name: str, impl) -> type:
    ns = {"get_name": classmethod(lambda cls: name), "get_impl_cls": classmethod(lambda cls: impl)}
    return type(name, (TorchNativeBackend,), ns)


@contextlib.contextmanager
def _softmax(fn):
    """Run the torch_native attention with another sink softmax (this module's bug)."""
    saved = tn_attention.softmax_with_sinks
    tn_attention.softmax_with_sinks = fn
    try:
        yield
    finally:
        tn_attention.softmax_with_sinks = saved


class _DropsSinksImpl(TorchNativeAttentionImpl):
    def __init__(self, *args, sinks=None, **kwargs):
        super().__init__(*args, **kwargs)  # sinks accepted, then forgotten


def _sink_in_numerator(logits, sinks):
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    probs = torch.softmax(torch.cat([logits, sinks.expand(*logits.shape[:-1], 1)], dim=-1), dim=-1)
    visible = torch.isfinite(logits)
    return probs[..., :-1] + probs[..., -1:] * visible


class _SinkInNumeratorImpl(TorchNativeAttentionImpl):
    def forward(self, *args, **kwargs):
        with _softmax(_sink_in_numerator):
            return super().forward(*args, **kwargs)


class _SinkWithoutScaleImpl(TorchNativeAttentionImpl):
    def forward(self, *args, **kwargs):
        scale = self.scale

        def unscaled(logits, sinks):
            if sinks is None:
                return torch.softmax(logits, dim=-1)
            col = (sinks * scale).expand(*logits.shape[:-1], 1)  # as if sink and q.k shared the scale
            return torch.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1]

        with _softmax(unscaled):
            return super().forward(*args, **kwargs)


DropsSinks = _backend("drops_sinks", _DropsSinksImpl)
SinkInNumerator = _backend("sink_in_numerator", _SinkInNumeratorImpl)
SinkWithoutScale = _backend("sink_without_scale", _SinkWithoutScaleImpl)
