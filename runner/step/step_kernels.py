"""The step compiler's kernels: the loops of stages 1-3 and 8 behind one small interface.

:class:`StepKernels` is the seam between the step modules and the loops that carry the
step's cost. Two implementations, chosen once per ``StepCompiler`` (``kernels.choose_kernels``):

* ``NumpyKernels`` (``numpy_kernels.py``) — vectorized numpy (plus ``struct`` for Python
  int lists).
* ``CompiledKernels`` (``kernels.py``) — the Cython loops of ``runner/step/fast/``, bound to
  the batch's columns and the checker's and preparer's buffers on first use.

The operations: ``pack_ints`` (Python int lists → one ``int32`` buffer), ``scan_cached``
and ``scan_new`` (stage 1's fast plans), ``merge_cached`` (stage 2's merge of a plan's
cached deltas), ``clear_rows`` and ``move_rows`` (every group's block table),
``null_skipped`` (stage 2's sliding-window nulling), ``write_new_rows`` (rows of the
requests ``scan_new`` staged), ``prepare`` (stage 3's per-token arithmetic) and
``prepare_patched`` (``prepare`` with the asynchronous patch: one pass on the compiled
kernels), with ``host_tokens`` (may it read the patch's tokens in place?), and
``append_tokens`` / ``append_verified`` / ``append_placeholders`` / ``fill_placeholders``
(stage 8: one checking and one writing pass each on the compiled kernels; the numpy ones
decline, and the numpy code of ``append.py`` / ``spec_apply.py`` / ``placeholders.py``
runs). A scan either plans its whole input or declines and changes nothing; on a decline
the vectorized checks (``runner/step/check/``) plan the step, and they word every error,
so the numpy kernels' scans always decline. Everything else gives the same bytes on both
implementations (the two-kernel tests of ``tests/runner/step/``, the step-oracle tests).

Only ``kernels.py`` and ``compiler.py`` import ``runner.step.fast`` (``tests/test_layers.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from attnplug.runner.step.plan import ScanBuffers
from attnplug.runner.step.prepare_buffers import PrepareBuffers

if TYPE_CHECKING:
    from attnplug.cache_groups.block_table import MultiGroupBlockTable
    from attnplug.runner.step.groups import StepLayout


class StepKernels(Protocol):
    """The loops of a step (see the module docstring)."""

    name: str
    """``"numpy"`` or ``"compiled"``."""

    def pack_ints(self, seqs: list, out: np.ndarray) -> tuple[int, int, int]:
        """Pack ``seqs`` (lists/tuples of ints, or 1-D integer arrays) back to back into
        ``out`` (``int32``, room for all), each value in ``[0, 2**31)``.

        Returns:
            ``(count, min, max)`` (``0, 0`` extremes when empty), or ``(-(i + 1), 0, 0)``
            when sequence ``i`` is not one of those or holds a bad value (``out`` is then
            garbage)."""

    def scan_cached(self, batch: Any, layout: "StepLayout", bufs: ScanBuffers, d: Any,
                    finished: list[str]) -> Any:
        """Plan the cached requests (and drafts) of the output ``d`` (``check.snapshot.Deltas``;
        its drafts and appends may be packed, ``d.packed``: read as arrays) into ``bufs``; return the scan (its counts: ``num_cached``, ``num_appends``,
        ``total_tokens``, ``num_spec``, ``spec_total``), or ``None`` to decline."""

    def scan_new(self, batch: Any, layout: "StepLayout", new_reqs: list, counts: list[int]) -> bool:
        """Check and stage the new requests; ``False`` declines."""

    def write_new_rows(self, batch: Any, layout: "StepLayout", rows: list[int]) -> None:
        """Write the requests the last accepted ``scan_new`` staged into vacant ``rows``."""

    def merge_cached(self, batch: Any, plan: Any, rows_c: np.ndarray) -> None:
        """Stage 2: merge the cached requests' deltas of ``plan`` (an ``UpdatePlan``) into
        their rows ``rows_c``: counts, token deltas, replaced and appended block ids."""

    def clear_rows(self, table: "MultiGroupBlockTable", rows: list[int]) -> None:
        """Every group: rows' blocks back to ``NULL_BLOCK_ID``, counts 0."""

    def move_rows(self, table: "MultiGroupBlockTable", srcs: list[int], dsts: list[int]) -> None:
        """Every group: rows ``srcs`` into the vacant rows ``dsts`` (disjoint), sources cleared."""

    def null_skipped(self, batch: Any, windows: list[int | None]) -> int:
        """Stage 2: ``NULL_BLOCK_ID`` over the sliding-window blocks newly skipped in rows
        ``0 .. num_reqs - 1`` (``runner/step/apply_windows.py``; ``windows``: per group ``W``
        tokens or ``None``); returns the manager entries written."""

    def prepare(self, batch: Any, bufs: PrepareBuffers, writes_slots: tuple[bool, ...], R: int,
                num_tokens_padded: int | None) -> tuple[int, int, int]:
        """Fill ``bufs`` and every group's host slot mapping for rows ``0 .. R - 1``.

        Returns:
            ``(num_actual_tokens, max_query_len, max_seq_len)``.

        Raises:
            MetadataError: a token read from the history is a placeholder (a sampled token
                neither patched by ``prev_token_ids`` nor filled: ``placeholders.py``); the
                step's buffers are written, nothing else."""

    def write_drafts(self, batch: Any, rows: np.ndarray | None, lens: np.ndarray | None,
                     flat: np.ndarray | None) -> None:
        """Stage 2: every row's ``num_spec_tokens`` to 0, then row ``rows[i]``'s ``lens[i]``
        drafts (``flat``, ``int32``, request after request) after its ``num_tokens`` tokens
        (``rows`` / ``lens`` ``[n]`` ``int64``; ``None``: no drafts this step)."""

    def spec_layout(self, batch: Any, bufs: PrepareBuffers, R: int) -> tuple[int, int, list[int]]:
        """Stage 3 of a step with drafts: fill ``bufs.spec_*`` for the rows of ``0 .. R - 1``
        whose logits are kept (``runner/step/spec_metadata.py``); the drafts are read from
        the host ``input_ids``.

        Returns:
            ``(num_kept_rows, num_drafts, draft count per kept row)``."""

    def append_tokens(self, batch: Any, rows: np.ndarray, max_model_len: int, held: np.ndarray,
                      tokens: np.ndarray) -> bool:
        """Stage 8, one token a row (``append.append_output_tokens``): when ``rows`` pass
        :meth:`append_placeholders`' checks, append ``tokens`` (``[n]`` ``int32``, checked
        ids) after them (their positions into ``held``) and return ``True``. Else ``False``
        and nothing written (always, on the numpy kernels): the numpy code words the error."""

    def append_verified(self, batch: Any, rows: np.ndarray, max_model_len: int, token_ids: Any) -> bool:
        """Stage 8 of a step with drafts (``spec_apply.append_verified_tokens``): when ``rows``
        (``[n]`` ``int64``) pass :meth:`append_placeholders`' checks (each row's drafts
        counted in its ``seq_len``) and row ``i`` emitted ``1 .. 1 + drafts`` tokens
        (``token_ids[i]``, ids under stage 8's typing rule) within ``max_model_len``, write
        them from each row's ``num_tokens`` on, clear its drafts and return ``True``. Else
        ``False``, nothing written (always, on the numpy kernels, which pack nothing)."""

    def append_placeholders(self, batch: Any, rows: np.ndarray, max_model_len: int,
                            held: np.ndarray) -> tuple[str, ...] | None:
        """Stage 8, asynchronous (``placeholders.append_placeholders``): when every one of
        ``rows`` (``[n]`` ``int64``, in the order of the step's sampled tensor) is a distinct
        row of ``0 .. num_reqs - 1`` holding a request that samples this step below
        ``max_model_len``, append a placeholder to each (its position into ``held``,
        ``[n]`` ``int64``), point ``prev_sampled_index`` / ``prev_sampled_pos`` at them and
        return the rows' request ids. Else ``None`` and nothing written (always, on the
        numpy kernels): the numpy code checks, words the error, and writes."""

    def fill_placeholders(self, batch: Any, requests: dict, placeholders: Any, toks: np.ndarray) -> int:
        """Stage 8, asynchronous (``placeholders.fill_output_tokens``): write ``toks`` (``[n]``
        ``int32``, checked) over ``placeholders``' entries wherever their requests' rows are
        now (the recorded rows while ``batch.layout`` is the one recorded), skipping requests
        that finished. Returns how many were written, or -1 with nothing written (always,
        on the numpy kernels): a request that left the batch but not ``requests``, or a
        placeholder not where it should be; the numpy code then decides and words errors."""

    def host_tokens(self, prev_token_ids: object, n: int) -> int:
        """The host address of ``prev_token_ids``' first element when :meth:`prepare_patched`
        may read its ``n`` tokens in place: exactly a ``torch.Tensor``, on the CPU, ``int64``,
        1-D, ``n`` elements at unit stride. Else -1 (always, on the numpy kernels): the caller
        checks or converts it with ``placeholders.prev_tokens_tensor``, which words every
        refusal. Never raises. The compiled kernels read those facts in one call (DLPack's C
        exchange API, its DLPack include under ``runner/step/fast/``), not one torch attribute each."""

    def prepare_patched(self, batch: Any, bufs: PrepareBuffers, writes_slots: tuple[bool, ...], R: int,
                        num_tokens_padded: int | None, prev_token_ids: torch.Tensor, expected: int,
                        prev_host: int = -1) -> tuple[int, int, int, int, bool, bool]:
        """Asynchronous scheduling: :meth:`prepare` and the patch of this step's
        ``input_ids`` (``runner/step/placeholders.py``): plan it into ``bufs.patch_dest`` /
        ``bufs.patch_src`` (``dest`` ascending; a contiguous plan, ``arange(k)``, need not be
        written there), consume rows ``0 .. R - 1``'s ``prev_sampled_index`` (-1
        afterwards) and count the step in ``bufs.patch_steps`` when ``k > 0``. ``prev_token_ids``: the previous step's sampled tokens, ``[n]``
        integer, as ``placeholders.prev_tokens_tensor`` returns it (on the device, or a 1-D
        ``int64`` CPU tensor with unit stride); when :func:`~attnplug.runner.step.numpy_kernels.writes_host_tokens`
        (a CPU device and such a CPU tensor) the kernels also write them into the host
        ``input_ids``, each checked in ``[0, 2**31)``, else the caller copies them on the
        device (``placeholders.finish_patch``). ``prev_host``: :meth:`host_tokens`' address
        of it (its ``n`` is ``batch.num_prev_sampled``), or -1 when it came through
        ``prev_tokens_tensor`` instead.

        The patch is applied only when the step passes the caller's next check:
        ``num_actual_tokens == expected`` (``-1``: no check) and ``num_tokens_padded`` is
        ``None`` or at least ``num_actual_tokens``; else ``k = 0`` and the columns stay.

        Returns:
            ``(num_actual_tokens, max_query_len, max_seq_len, k, contiguous, written)``:
            ``k`` tokens to patch; ``contiguous`` when ``dest == src == arange(k)``;
            ``written``: the tokens were written.

        Raises:
            MetadataError: a source index outside ``prev_token_ids``, a token taken from
                it outside ``[0, 2**31)``, or, as :meth:`prepare`, a placeholder outside the
                patch; nothing consumed."""


__all__ = ["StepKernels"]
