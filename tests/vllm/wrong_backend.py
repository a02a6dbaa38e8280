"""A deliberately wrong attnplug backend: torch_native with the softmax scale halved.

Served through the vLLM bridge it must change vLLM's greedy tokens (``test_vllm_bridge``):
the proof that the bridge's tokens come from the attnplug backend, not from vLLM's own.
"""

from __future__ import annotations

from attnplug.backends.torch_native import TorchNativeAttentionImpl, TorchNativeBackend


class HalfScaleImpl(TorchNativeAttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, **kw):
        super().__init__(num_heads, head_size, scale * 0.5, num_kv_heads, **kw)


class WrongScaleBackend(TorchNativeBackend):
    @classmethod
    def get_name(cls) -> str:
        return "wrong_scale"

    @classmethod
    def get_impl_cls(cls):
        return HalfScaleImpl
