"""Feature declarations the paged decoder backends share word for word:
``WindowAndSoftCapFeatures`` (``torch_native``, ``triton``, ``flash_attn``, ``flashinfer``,
``cpu_sdpa``) and ``SinksAndAlibiFeatures`` (``torch_native``, ``triton``, ``cpu_sdpa``)."""

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


class SinksAndAlibiFeatures:
    """Declares attention sinks and ALiBi (``supports_sink`` / ``supports_alibi`` of
    ``core/capabilities.FeatureDeclarations``) for a backend whose impl takes ``sinks`` and
    ``alibi_slopes`` (``backends/common/decoder_impl.SinksAlibiDecoderImpl``'s arguments) and
    applies them. A mixin, listed before ``AttentionBackend`` in the bases."""

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_alibi(cls) -> bool:
        return True
