"""vLLM's ``CommonAttentionMetadata`` (0.32, 0.33: the same fields) -> attnplug's, field by field.

What attnplug needs that vLLM does not carry is derived here:

* ``seq_lens_cpu``: ``seq_lens`` itself when it lives on the CPU; otherwise one
  device->host copy per step (``seq_lens.cpu()``, a synchronisation). vLLM's
  ``seq_lens_cpu_upper_bound`` is not used: it overstates decode rows under async
  speculative decoding.
* ``num_computed_tokens_cpu``: ``seq_lens_cpu - query_lens`` (host arithmetic on
  ``query_start_loc_cpu``, no copy).
* ``num_actual_tokens``: ``query_start_loc_cpu[num_reqs]`` (vLLM's may count padding).
* ``max_query_len`` / ``max_seq_len``: exact maxima of the host lengths (vLLM's
  ``max_seq_len`` may be an upper bound).
* ``is_prefilling``: vLLM's, moved to the CPU if it is not there (one more copy); ``None``
  stays ``None``.

Refused (``MetadataError``): what attnplug's contract cannot express -- per-request
causality (a ``causal`` tensor), bidirectional multimodal prefix ranges
(``mm_req_doc_ranges``), a reference-sliding-window prefix (``rswa_prefix_lens``), decode
context parallelism (``dcp_local_seq_lens``) and encoder lengths (``encoder_seq_lens``).
vLLM sends these only to backends that declare them (``supports_mm_prefix``,
``supports_rswa``, ``supports_dcp``, encoder attention types), which the bridge does not;
the check makes a vLLM that sends them anyway fail loudly.

Shared as is (no copy): ``query_start_loc``, ``query_start_loc_cpu``, ``seq_lens``,
``block_table_tensor`` (int32, kernel blocks), ``slot_mapping`` (int64), ``positions``.
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata


UNSUPPORTED_FIELDS: tuple[str, ...] = ("mm_req_doc_ranges", "rswa_prefix_lens", "dcp_local_seq_lens",
                                       "encoder_seq_lens")
"""vLLM metadata fields that must be ``None`` for the bridge (module docstring)."""


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.device.type == "cpu" else t.cpu()


def from_vllm(cm: Any) -> CommonAttentionMetadata:
    """attnplug's :class:`CommonAttentionMetadata` for vLLM's ``cm`` (a 0.32 / 0.33
    ``vllm.v1.attention.backend.CommonAttentionMetadata``); tensors shared where the
    module docstring says so.

    Raises:
        MetadataError: a field attnplug's contract cannot express (module docstring),
            naming it.
    """
    if isinstance(cm.causal, torch.Tensor) or cm.causal is not True:
        raise MetadataError(f"vLLM passed causal={cm.causal!r}; attnplug backends serve causal decoder "
                            "attention only")
    for field in UNSUPPORTED_FIELDS:
        if getattr(cm, field, None) is not None:
            raise MetadataError(f"vLLM passed {field} (not None); the attnplug bridge does not serve it "
                                "(plugins/vllm/metadata.py)")
    num_reqs = int(cm.num_reqs)
    qsl_cpu = cm.query_start_loc_cpu[: num_reqs + 1].to(torch.int32)
    seq_lens_cpu = _host(cm.seq_lens)[:num_reqs].to(torch.int32)
    query_lens = qsl_cpu[1:] - qsl_cpu[:-1]
    return CommonAttentionMetadata(
        query_start_loc=cm.query_start_loc[: num_reqs + 1],
        query_start_loc_cpu=qsl_cpu,
        seq_lens=cm.seq_lens[:num_reqs],
        seq_lens_cpu=seq_lens_cpu,
        num_computed_tokens_cpu=seq_lens_cpu - query_lens,
        num_reqs=num_reqs,
        num_actual_tokens=int(qsl_cpu[-1]),
        max_query_len=int(query_lens.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens_cpu.max()) if num_reqs else 0,
        block_table_tensor=cm.block_table_tensor[:num_reqs],
        slot_mapping=cm.slot_mapping,
        causal=True,
        positions=cm.positions,
        is_prefilling=None if cm.is_prefilling is None else _host(cm.is_prefilling)[:num_reqs],
    )
