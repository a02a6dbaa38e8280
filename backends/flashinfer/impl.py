"""``FlashInferImpl``: write this step's K/V, then ``run()`` the planned wrappers on the
decode slice and the prefill slice.

fp8 KV cache (``fp8_e4m3`` / ``fp8_e5m2``): K/V are written ``saturate(x / scale)`` with the
layer's ``k_scale`` / ``v_scale`` (``core/kv_quant.py``) and the wrappers are planned with
``kv_data_type`` = the cache dtype. FlashInfer's ``run(..., k_scale=, v_scale=)`` takes one
python float each (per tensor; it multiplies ``sm_scale`` by ``k_scale`` and the output by
``v_scale``): per-tensor scales go there, converted to floats once per scale value (a host
sync only when the scale tensor changes: ``_ScaleFloats``). Per-KV-head scales, which
FlashInfer cannot take, are folded exactly: the query heads of KV head ``g`` are
multiplied by ``k_scale[g]`` before ``run()`` (``sm_scale * (q * ks) . k == sm_scale * ks *
(q . k)``, before any soft-cap, as FlashInfer applies ``k_scale``) and their output rows by
``v_scale[g]`` after it (the sink column has no value, so sinks are unaffected).
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug.backends.common.cache_write import write_kv_by_slot
from attnplug.backends.common.shape_checks import qkv_shape_problems
from attnplug.backends.common.kv_scales import kv_scales_for
from attnplug.backends.common.value_checks import check_page_ids, check_slots, values_checked
from attnplug.backends.common.window import flashinfer_window_left
from attnplug.backends.flashinfer.kernels import LIVE_LAYER_PARAMS
from attnplug.backends.flashinfer.metadata import FlashInferMetadata, FlashInferPlanKey
from attnplug.core.contracts import AttentionImpl, AttentionType
from attnplug.core.errors import BackendUnsupportedError, MetadataError
from attnplug.core.kv_quant import is_quantized


class FlashInferImpl(AttentionImpl):
    """The attention of one layer with FlashInfer.

    ``FlashInferImpl(num_heads, head_size, scale, num_kv_heads, sliding_window=None,
    logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_cache_dtype=None, sinks=None)``.
    Creating it registers its parameters for the group's builder to plan. ``sinks``
    (``[num_heads]`` float32, ``core/contracts.AttentionImpl``) goes to both wrappers'
    ``run(..., sinks=)`` (flashinfer-python 0.6.18's keyword: one sink logit per query head).

    Raises:
        BackendUnsupportedError: ``num_heads`` not a multiple of ``num_kv_heads``, a
            non-positive window or cap, a non-decoder attention type, or malformed ``sinks``.
    """

    backend_name = "flashinfer"

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 attn_type: AttentionType = AttentionType.DECODER,
                 kv_cache_dtype: torch.dtype | None = None, sinks: torch.Tensor | None = None):
        reasons = self.decoder_argument_problems(num_heads, num_kv_heads, sliding_window, logits_soft_cap,
                                                 attn_type)
        reasons += self.sinks_argument_problems(sinks, num_heads)
        if reasons:
            raise BackendUnsupportedError(self.backend_name, reasons, context=type(self).__name__)
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap,
                         attn_type, kv_cache_dtype, sinks)
        self.plan_key = FlashInferPlanKey(num_heads, flashinfer_window_left(sliding_window),
                                          float(logits_soft_cap or 0.0), float(scale))
        self._scale_floats = _ScaleFloats()
        LIVE_LAYER_PARAMS.add(self)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: FlashInferMetadata,
                output: torch.Tensor) -> torch.Tensor:
        """Write this step's K/V at the slot mapping, then run the decode and prefill wrappers.

        Args:
            layer: the calling module, or ``None``; an fp8 cache reads its ``k_scale`` /
                ``v_scale`` (float32 ``[]`` or ``[num_kv_heads]``, absent = 1.0).
            query: ``[num_tokens, num_heads, head_size]``, float16/bfloat16 (the planned dtype).
            key, value: ``[num_tokens, num_kv_heads, head_size]``, same dtype and device.
            kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (FlashInfer NHD),
                written in place at the real slots only.
            attn_metadata: what :class:`FlashInferMetadataBuilder` built this step.
            output: ``[num_tokens, num_heads, head_size]``, contiguous, query's dtype and
                device (FlashInfer's ``o_data_type`` is the query's); the decode rows
                ``[0, num_decode_tokens)`` and the prefill rows are overwritten.

        Returns:
            ``output``.

        Raises:
            MetadataError: shapes that disagree, or no plan for this layer's parameters
                (the impl was created after the builder's ``build``); and where index values
                are checked (CPU tensors always, a GPU with ``ATTNPLUG_VALIDATE=1``:
                :mod:`~attnplug.backends.common.value_checks`) a slot or page id outside
                ``kv_cache`` (the cache is unchanged then).

        Does not synchronise with the host (``run()`` only); graph-capturable for
        pure-decode steps.
        """
        md = attn_metadata
        plan = self._check(query, key, value, kv_cache, md, output)
        if values_checked(query.device):  # the kernels trust these values; checked before the write
            check_slots(md.slot_mapping, kv_cache.shape[0], kv_cache.shape[2], "flashinfer forward")
            check_page_ids(md.paged_kv_indices, kv_cache.shape[0], "flashinfer forward")
        k_scale, v_scale = kv_scales_for(layer, self.num_kv_heads, kv_cache.dtype, "flashinfer forward")
        write_kv_by_slot(key, value, kv_cache[:, 0], kv_cache[:, 1], md.slot_mapping, k_scale, v_scale)
        nd = md.num_decode_tokens
        extra = self._sink_kwargs(query.device)
        head_v = None
        if is_quantized(kv_cache.dtype):
            query, head_v, scale_kwargs = self._fp8_scales(query, k_scale, v_scale)
            extra.update(scale_kwargs)
        if plan.decode is not None:
            plan.decode.run(query[:nd], kv_cache, out=output[:nd], **extra)
        if plan.prefill is not None:
            lo = md.num_decodes
            plan.prefill.run(query[lo: md.num_actual_tokens], kv_cache, out=output[lo: md.num_actual_tokens], **extra)
        if head_v is not None:  # per-KV-head v_scale, folded: each query head's rows times its KV head's
            rows = output[: md.num_actual_tokens]
            rows.copy_((rows.float() * head_v.view(1, -1, 1)).to(rows.dtype))
        return output

    def _fp8_scales(self, query: torch.Tensor, k_scale, v_scale):
        """``(query, head_v_scale, run_kwargs)`` for an fp8 cache (module docstring):
        per-tensor scales as ``run(k_scale=, v_scale=)`` floats; per-KV-head ones folded into
        a scaled copy of ``query`` and a ``[num_heads]`` float32 output factor."""
        kwargs, head_v = {}, None
        group = self.num_heads // self.num_kv_heads
        if k_scale is not None and k_scale.dim() == 1:
            ks = k_scale.to(query.device).repeat_interleave(group).view(1, -1, 1)
            query = (query.float() * ks).to(query.dtype)
        elif k_scale is not None:
            kwargs["k_scale"] = self._scale_floats.get(k_scale)
        if v_scale is not None and v_scale.dim() == 1:
            head_v = v_scale.to(query.device).repeat_interleave(group)
        elif v_scale is not None:
            kwargs["v_scale"] = self._scale_floats.get(v_scale)
        return query, head_v, kwargs

    def _sink_kwargs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """``{"sinks": [num_heads] float32 on device}`` for ``run()``, or ``{}`` without sinks."""
        if self.sinks is None:
            return {}
        if self.sinks.device != device:
            self.sinks = self.sinks.to(device)
        return {"sinks": self.sinks}

    def _check(self, query, key, value, kv_cache, md, output):
        if not isinstance(md, FlashInferMetadata):
            raise MetadataError(f"attn_metadata is a {type(md).__name__}, not FlashInferMetadata: the layer's "
                                "metadata must come from the flashinfer builder of its cache group.")
        problems = qkv_shape_problems(query, key, value, self.num_heads, self.num_kv_heads, self.head_size)
        if output.shape != query.shape or not output.is_contiguous():
            problems.append(f"output {tuple(output.shape)} should be contiguous and match query {tuple(query.shape)}")
        if output.dtype != query.dtype or output.device != query.device:
            problems.append(f"output is {output.dtype} on {output.device}; run() writes query's dtype {query.dtype} "
                            f"on {query.device}")
        need = max(md.num_actual_tokens, md.num_decode_tokens, md.slot_mapping.shape[0])
        if min(query.shape[0], key.shape[0], value.shape[0]) < need:
            problems.append(f"query/key/value have fewer than {need} rows (tokens of the step, padding included)")
        shape = (2, md.page_size, self.num_kv_heads, self.head_size)
        if kv_cache.dim() != 5 or tuple(kv_cache.shape[1:]) != shape:
            problems.append(f"kv_cache {tuple(kv_cache.shape)} should be [num_blocks, {', '.join(map(str, shape))}]")
        plan = md.plans.get(self.plan_key)
        if plan is None and not problems:
            planned = sorted(map(str, md.plans))
            problems.append(f"no plan for this layer's parameters {self.plan_key} (planned: {planned}); "
                            "create every layer's impl before the first build(): the builder plans the live impls'")
        if problems:
            raise MetadataError("flashinfer forward: " + "; ".join(problems) + ".")
        return plan


class _ScaleFloats:
    """Python floats of per-tensor scale tensors (FlashInfer's ``run(k_scale=)`` takes
    ``Optional[float]``), converted once per tensor value: the cache key is the tensor's
    identity and its in-place version counter, so a recalibrated scale (``copy_``) is read
    again (one host sync then), an unchanged one never."""

    def __init__(self) -> None:
        self._floats: dict[int, tuple[Any, int, float]] = {}

    def get(self, scale: torch.Tensor) -> float:
        hit = self._floats.get(id(scale))
        if hit is not None and hit[0] is scale and hit[1] == scale._version:
            return hit[2]
        value = float(scale)
        self._floats[id(scale)] = (scale, scale._version, value)
        return value
