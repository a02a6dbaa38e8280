"""Checks of the step tensors a builder lowers (``build`` and ``update_block_table``), and
the copies into persistent (CUDA-graph) buffers: shared by the triton and flash_attn
builders (flashinfer uses the slot-mapping check).

Two kinds of check:

* **structure** — shapes, dtypes, devices and sizes against the builder's buffers: host
  ints only, a few hundred nanoseconds, run on every build;
* **values** — what the host copies say (``query_start_loc_cpu[num_reqs] ==
  num_actual_tokens``, ``0 <= query_len <= seq_len``, the ``max_*`` bounds): reading and
  reducing host tensors costs ~10-20 µs a step, so builders run them only when
  :func:`builder_values_checked` (``ATTNPLUG_VALIDATE=1``, which ``make test`` sets; read
  when the builder is created). The impls check the index values they hand to a kernel
  on their own (``backends/common/value_checks.py``), so an eager CPU step with a bad
  slot is still refused before any write.
"""

from __future__ import annotations

import torch

from attnplug.cache_groups.specs import cdiv
from attnplug.core import switches
from attnplug.core.devices import same_device
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata


def builder_values_checked() -> bool:
    """Whether builders created now check the host values of each step (``ATTNPLUG_VALIDATE=1``)."""
    return switches.flag("ATTNPLUG_VALIDATE")


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    """``t`` lives on ``device`` (a resolved device; the plain comparison first: it is cheap)."""
    return t.device == device or same_device(t.device, device)


def check_step_tensors(cm: CommonAttentionMetadata, num_rows: int, device: torch.device, backend: str) -> None:
    """``query_start_loc`` / ``seq_lens`` are int32 on ``device`` with at least ``num_rows + 1``
    / ``num_rows`` entries, and their host copies cover the ``num_reqs`` real rows.

    Raises:
        MetadataError: otherwise, naming ``backend`` and the sizes.
    """
    qsl, sl, n = cm.query_start_loc, cm.seq_lens, cm.num_reqs
    if (qsl.shape[0] < num_rows + 1 or sl.shape[0] < num_rows or cm.query_start_loc_cpu.shape[0] < n + 1
            or cm.seq_lens_cpu.shape[0] < n):
        raise MetadataError(
            f"query_start_loc has {qsl.shape[0]} entries (host copy {cm.query_start_loc_cpu.shape[0]}) and "
            f"seq_lens {sl.shape[0]} (host copy {cm.seq_lens_cpu.shape[0]}) for {num_rows} rows "
            f"(num_reqs={n}): expected >= rows + 1 and >= rows.")
    for name, t in (("query_start_loc", qsl), ("seq_lens", sl)):
        if t.dtype is not torch.int32 or not on_device(t, device):
            raise MetadataError(f"{name} is {t.dtype} on {t.device}; the {backend} builder needs torch.int32 on "
                                f"{device} (the compute device).")


def check_step_values(cm: CommonAttentionMetadata, max_model_len: int | None = None) -> None:
    """The host copies agree with the host ints: ``query_start_loc_cpu[num_reqs] ==
    num_actual_tokens``, ``0 <= query_len <= seq_len`` per row, ``max_seq_len`` /
    ``max_query_len`` bound them, and (given) no ``seq_len`` exceeds ``max_model_len``.

    Raises:
        MetadataError: naming the first broken condition (and the row).
    """
    n = cm.num_reqs
    qsl = cm.query_start_loc_cpu[: n + 1].long()
    if int(qsl[-1]) != cm.num_actual_tokens:
        raise MetadataError(
            f"query_start_loc_cpu[num_reqs]={int(qsl[-1])} but num_actual_tokens={cm.num_actual_tokens}: "
            "they must agree (the flat token count).")
    if not n:
        return
    query_lens = qsl[1:] - qsl[:-1]
    seq_lens = cm.seq_lens_cpu[:n].long()
    bad = (query_lens < 0) | (seq_lens < query_lens)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise MetadataError(
            f"request {i}: query length {int(query_lens[i])} with seq_len {int(seq_lens[i])}: need "
            "0 <= query_len <= seq_len (seq_len = num_computed_tokens + query_len).")
    longest, widest = int(seq_lens.max()), int(query_lens.max())
    if longest > cm.max_seq_len:
        raise MetadataError(f"max_seq_len={cm.max_seq_len} but seq_lens holds {longest}: "
                            "max_seq_len must bound every seq_len.")
    if widest > cm.max_query_len:
        raise MetadataError(f"max_query_len={cm.max_query_len} but a query has {widest} "
                            "tokens: max_query_len must bound every query length.")
    if max_model_len is not None and longest > max_model_len:
        raise MetadataError(f"a seq_len of {longest} exceeds BuilderConfig.max_model_len={max_model_len}.")


def check_slot_mapping(slot_mapping: torch.Tensor, num_actual_tokens: int, capacity: int,
                       device: torch.device) -> None:
    """``slot_mapping`` must be int64 ``[num_tokens]`` on ``device`` with
    ``num_actual_tokens <= num_tokens <= capacity`` (the persistent buffer's size).

    Raises:
        MetadataError: otherwise, with the values and the limit.
    """
    if slot_mapping.dim() != 1 or slot_mapping.dtype is not torch.int64 or not on_device(slot_mapping, device):
        raise MetadataError(f"slot_mapping is {slot_mapping.dtype} {tuple(slot_mapping.shape)} on "
                            f"{slot_mapping.device}; need int64 [num_tokens] on {device}.")
    if not num_actual_tokens <= slot_mapping.shape[0] <= capacity:
        raise MetadataError(
            f"slot_mapping has {slot_mapping.shape[0]} entries; need >= num_actual_tokens={num_actual_tokens} "
            f"and <= BuilderConfig.max_num_batched_tokens={capacity} (the persistent buffer's size).")


def check_block_table(block_table: torch.Tensor, num_rows: int, max_seq_len: int, *, block_size: int,
                      max_num_blocks_per_req: int, max_model_len: int, device: torch.device,
                      backend: str) -> None:
    """``block_table`` must be int32 ``[>= num_rows, width]`` on ``device`` and address
    ``max_seq_len`` tokens in blocks of ``block_size`` within ``min(width,
    max_num_blocks_per_req)`` columns.

    Raises:
        MetadataError: otherwise, naming ``backend``, the values and the limits.
    """
    if (block_table.dim() != 2 or block_table.shape[0] < num_rows or block_table.dtype is not torch.int32
            or not on_device(block_table, device)):
        raise MetadataError(
            f"block_table_tensor is {block_table.dtype} {tuple(block_table.shape)} on {block_table.device} "
            f"but num_reqs={num_rows}: the {backend} builder needs int32 [num_reqs, max_num_blocks_per_req] on "
            f"{device}.")
    need = cdiv(max_seq_len, block_size)
    if need > min(block_table.shape[1], max_num_blocks_per_req):
        raise MetadataError(
            f"max_seq_len={max_seq_len} needs {need} blocks of {block_size} tokens per request but the "
            f"block table has {block_table.shape[1]} columns and BuilderConfig.max_model_len="
            f"{max_model_len} allows {max_num_blocks_per_req}: the keys would be "
            "unaddressable; check max_model_len and the kernel block size.")


def copy_block_table(buffer: torch.Tensor, block_table: torch.Tensor, num_rows: int, live_cols: int) -> torch.Tensor:
    """Copy the live columns of the step's ``block_table`` rows into the persistent ``buffer``
    and return ``buffer[:num_rows]`` at its whole width.

    Only columns ``< live_cols`` (``cdiv(max_seq_len, block_size)``: every block a key of
    the step sits in) are copied, never the table's full width; columns left from earlier
    steps are never read, since the kernels read only the pages ``seq_lens`` needs. The
    whole persistent width is returned so that a CUDA graph captured on a narrow step
    replays wider ones.

    Args:
        buffer: ``[max_num_reqs, max_num_blocks_per_req]`` int32, the builder's.
        block_table: ``[>= num_rows, >= live_cols]`` int32 on ``buffer``'s device (checked by
            :func:`check_block_table`).
        num_rows: rows to copy (padded requests included).
        live_cols: columns to copy, ``<= buffer.shape[1]``.
    """
    if num_rows and live_cols:
        buffer[:num_rows, :live_cols].copy_(block_table[:num_rows, :live_cols], non_blocking=True)
    return buffer[:num_rows]


NOT_PASSED = (None,) * 7
"""A pass (:meth:`StepTensorChecks.pass_step`, :meth:`StepTensorChecks.pass_tables`) that
no step matches: its tensor entries are ``None``."""


class StepTensorChecks:
    """:func:`check_step_tensors`, :func:`check_slot_mapping` and :func:`check_block_table`
    for one builder, remembering the tensor objects they last passed.

    The step compiler hands its builders the same view objects step after step (views of
    its persistent buffers, ``runner/step/prepare.py``), and a tensor object's dtype,
    device and shape never change (nothing here resizes one in place). So when every
    tensor of a step *is* (``is``) the one last checked, only the host ints are compared
    against the remembered sizes (a dozen int comparisons instead of ~20 tensor attribute
    reads); any other tensor, or any size that does not fit, runs the full checks, which
    raise the usual errors. The memo holds references to the tensors, so no id is reused
    while it is kept.

    Args:
        device: the compute device (resolved).
        block_size: the kernel block size (tokens).
        max_num_blocks_per_req: the builder's block-table width.
        max_model_len: for the error message.
        slot_capacity: the slot-mapping buffer's length (``max_num_batched_tokens``).
        backend: named in error messages.
    """

    def __init__(self, *, device: torch.device, block_size: int, max_num_blocks_per_req: int, max_model_len: int,
                 slot_capacity: int, backend: str):
        self.device, self.block_size, self.backend = device, int(block_size), backend
        self.max_num_blocks_per_req, self.max_model_len = int(max_num_blocks_per_req), int(max_model_len)
        self.slot_capacity = int(slot_capacity)
        self._memo: tuple | None = None
        self._tables: tuple | None = None

    def pass_step(self, cm: CommonAttentionMetadata, num_rows: int) -> tuple:
        """Check ``cm``'s step tensors for ``num_rows`` rows in full (:func:`check_step_tensors`,
        :func:`check_slot_mapping`, :func:`check_block_table`) and return the pass, a tuple
        ``(query_start_loc, seq_lens, block_table_tensor, slot_mapping, num_rows,
        max_num_actual_tokens, max_max_seq_len)``: the four tensor objects checked, the row
        count, and the largest ``num_actual_tokens`` (the slot mapping's length) and
        ``max_seq_len`` (what the block table's columns address) they allow.

        A later step with the same four objects (``is``), the same ``num_rows``,
        ``num_actual_tokens <= max_num_actual_tokens`` and ``max_seq_len <= max_max_seq_len``
        passes these checks too (a tensor object's dtype, device and shape never change):
        builders keep the pass and compare those host ints, in their own frame, instead of
        calling the checks again. The host copies (``query_start_loc_cpu``,
        ``seq_lens_cpu``) are checked here; a builder that reads them on every build must
        not skip on the pass alone.

        Raises:
            MetadataError: as the three checks do.
        """
        check_step_tensors(cm, num_rows, self.device, self.backend)
        bt, sm = cm.block_table_tensor, cm.slot_mapping
        _, _, max_rows, max_tokens, max_seq_len = self.pass_tables(bt, sm, num_rows, cm.num_actual_tokens,
                                                                   cm.max_seq_len)
        return cm.query_start_loc, cm.seq_lens, bt, sm, num_rows, max_tokens, max_seq_len

    def pass_tables(self, block_table: torch.Tensor, slot_mapping: torch.Tensor, num_rows: int,
                    num_actual_tokens: int, max_seq_len: int) -> tuple:
        """:func:`check_slot_mapping` and :func:`check_block_table` in full; returns the pass
        ``(block_table, slot_mapping, max_num_rows, max_num_actual_tokens, max_max_seq_len)``
        (the bounds these two objects allow: block-table rows, slot-mapping length, and
        the tokens the addressable columns hold), as :meth:`pass_step`.

        Raises:
            MetadataError: as the two checks do.
        """
        check_slot_mapping(slot_mapping, num_actual_tokens, self.slot_capacity, self.device)
        check_block_table(block_table, num_rows, max_seq_len, block_size=self.block_size,
                          max_num_blocks_per_req=self.max_num_blocks_per_req, max_model_len=self.max_model_len,
                          device=self.device, backend=self.backend)
        cols = min(block_table.shape[1], self.max_num_blocks_per_req)
        return block_table, slot_mapping, block_table.shape[0], slot_mapping.shape[0], cols * self.block_size

    def check(self, cm: CommonAttentionMetadata, num_rows: int) -> None:
        """Check ``cm``'s step tensors for ``num_rows`` rows (see the class docstring).

        Raises:
            MetadataError: as the three checks do.
        """
        qsl, sl, qc, sc = cm.query_start_loc, cm.seq_lens, cm.query_start_loc_cpu, cm.seq_lens_cpu
        m = self._memo
        n = cm.num_reqs
        if not (m is not None and m[0] is qsl and m[1] is sl and m[2] is qc and m[3] is sc
                and m[4] > num_rows and m[5] >= num_rows and m[6] > n and m[7] >= n):
            check_step_tensors(cm, num_rows, self.device, self.backend)
            self._memo = (qsl, sl, qc, sc, qsl.shape[0], sl.shape[0], qc.shape[0], sc.shape[0])
        self.check_tables(cm.block_table_tensor, cm.slot_mapping, num_rows, cm.num_actual_tokens, cm.max_seq_len)

    def check_tables(self, block_table: torch.Tensor, slot_mapping: torch.Tensor, num_rows: int,
                     num_actual_tokens: int, max_seq_len: int) -> None:
        """:func:`check_slot_mapping` and :func:`check_block_table` alone (``build`` and
        ``update_block_table``), with their own memo of the two tensors.

        Raises:
            MetadataError: as the two checks do.
        """
        m = self._tables
        if (m is not None and m[0] is block_table and m[1] is slot_mapping and m[2] >= num_rows
                and num_actual_tokens <= m[4]
                and -(-max_seq_len // self.block_size) <= min(m[3], self.max_num_blocks_per_req)):
            return
        check_slot_mapping(slot_mapping, num_actual_tokens, self.slot_capacity, self.device)
        check_block_table(block_table, num_rows, max_seq_len, block_size=self.block_size,
                          max_num_blocks_per_req=self.max_num_blocks_per_req, max_model_len=self.max_model_len,
                          device=self.device, backend=self.backend)
        self._tables = (block_table, slot_mapping, block_table.shape[0], block_table.shape[1], slot_mapping.shape[0])
