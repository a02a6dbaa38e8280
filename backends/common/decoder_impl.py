"""``SinksAlibiDecoderImpl``: the constructor of a decoder-only impl that takes attention
sinks and ALiBi slopes (``torch_native``, ``triton``): every argument is checked first, all
problems are raised together, and only then is anything stored."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from attnplug.core.contracts import AttentionImpl, AttentionType
from attnplug.core.errors import BackendUnsupportedError


def alibi_slopes_argument_problems(alibi_slopes: Any, num_heads: int) -> list[str]:
    """Reasons ``alibi_slopes`` is not a valid ALiBi argument (empty: fine, or ``None``).

    Valid: a ``torch.Tensor`` of shape ``[num_heads]``, dtype float32 (vLLM's impl argument:
    one slope per query head); the same rule as ``AttentionImpl.sinks_argument_problems``,
    worded for slopes.
    """
    return [r.replace("sinks", "alibi_slopes").replace("sink logit", "ALiBi slope")
            for r in AttentionImpl.sinks_argument_problems(alibi_slopes, num_heads)]


class SinksAlibiDecoderImpl(AttentionImpl):
    """An :class:`~attnplug.core.contracts.AttentionImpl` whose constructor also takes
    ``alibi_slopes`` and checks, before storing anything: the decoder-only arguments
    (``AttentionImpl.decoder_argument_problems``), ``sinks`` and ``alibi_slopes`` (each
    ``[num_heads]`` float32 or ``None``), and the subclass's own limits
    (:meth:`extra_argument_problems`).

    Raises:
        BackendUnsupportedError: every problem found, named by :attr:`backend_name`, with
            :attr:`impl_name` as its context.
    """

    backend_name: ClassVar[str]
    """The backend named by the constructor's ``BackendUnsupportedError``."""
    impl_name: ClassVar[str]
    """The error's context (the impl class that states the rules; a subclass keeps it)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 attn_type: AttentionType = AttentionType.DECODER,
                 kv_cache_dtype: torch.dtype | None = None, sinks: torch.Tensor | None = None,
                 alibi_slopes: torch.Tensor | None = None):
        reasons = self.decoder_argument_problems(num_heads, num_kv_heads, sliding_window, logits_soft_cap,
                                                 attn_type)
        reasons += self.sinks_argument_problems(sinks, num_heads)
        reasons += alibi_slopes_argument_problems(alibi_slopes, num_heads)
        reasons += self.extra_argument_problems(head_size)
        if reasons:
            raise BackendUnsupportedError(self.backend_name, reasons, context=self.impl_name)
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap,
                         attn_type, kv_cache_dtype, sinks)
        self.alibi_slopes = alibi_slopes
        """``[num_heads]`` float32 ALiBi slopes or ``None``: head ``h``'s logit of a key ``d``
        positions back gets ``- alibi_slopes[h] * d``."""

    @classmethod
    def extra_argument_problems(cls, head_size: int) -> list[str]:
        """The subclass's own limits on the constructor's arguments (none here)."""
        return []
