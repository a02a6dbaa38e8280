"""``WindowAndSoftCapFeatures``: the feature declarations the paged decoder backends
(``torch_native``, ``triton``, ``flash_attn``, ``flashinfer``, ``cpu_sdpa``) share word for word."""

from __future__ import annotations


class WindowAndSoftCapFeatures:
    """Declares sliding window and logits soft-cap (``supports_sliding_window`` /
    ``supports_logits_soft_cap`` of ``core/capabilities.FeatureDeclarations``) for a backend
    whose impl applies both. A mixin: list it before ``AttentionBackend`` in the bases. (GQA/MQA
    is the base's default already.)"""

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        return True
