"""Block tables: per batch row, the physical blocks of one cache group, in logical order.

``BlockTable`` serves one cache group; ``MultiGroupBlockTable`` holds one per group and
forwards every row operation to all of them (a row is one request in every group).

Two block sizes meet here (vLLM's ``map_to_kernel_blocks``): the *manager* block size
``B`` that the block pool hands out, and the *kernel* block size ``B / k`` the attention
kernel pages by. The CPU mirror ``block_table_np`` keeps manager ids (what the scheduler
sends); the kernel table ``kernel_block_table`` holds each manager block ``b`` expanded to
``b*k .. b*k+k-1`` (``NULL_BLOCK_ID`` stays ``NULL_BLOCK_ID`` in all ``k`` entries, so
the columns past a row's blocks stay null). The expansion is done when rows are written,
so ``commit`` is a plain prefix copy. With ``k == 1`` both tables share one buffer.

Slot mapping (docs/architecture.md, "Conventions"): ``slot = block_table[req, pos // B] * B + pos % B``,
vectorized over the step's tokens into a persistent buffer; padded tokens get
``PAD_SLOT_ID``. The slot is the same whether computed in manager or kernel blocks.

Invariant kept by every operation: entries of a row past its ``num_blocks_per_row`` are
``NULL_BLOCK_ID`` (in both tables).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from attnplug.cache_groups.buffers import CpuGpuBuffer
from attnplug.cache_groups.ragged import cumsum_and_arange
from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.devices import resolve_device
from attnplug.core.errors import KVCacheSpecError, MetadataError


def expand_to_kernel_block_ids(block_ids, kernel_blocks_per_block: int) -> np.ndarray:
    """Expand manager block ids into kernel block ids.

    Args:
        block_ids: ``[n]`` manager block ids (ints).
        kernel_blocks_per_block: ``k = manager block size // kernel block size``.

    Returns:
        ``[n * k]`` ``int32``: manager block ``b`` becomes ``b*k .. b*k+k-1``;
        ``NULL_BLOCK_ID`` becomes ``k`` entries of ``NULL_BLOCK_ID``.

    Examples:
        >>> expand_to_kernel_block_ids([1, 2, 3], 2).tolist()   # 32-token blocks, 16-token kernel
        [2, 3, 4, 5, 6, 7]
        >>> expand_to_kernel_block_ids([0, 1], 2).tolist()      # the null block stays null
        [0, 0, 2, 3]
    """
    ids = np.asarray(block_ids, dtype=np.int32)
    k = int(kernel_blocks_per_block)
    if k == 1:
        return ids.copy()
    out = (ids[:, None] * k + np.arange(k, dtype=np.int32)).reshape(-1)
    out[np.repeat(ids == NULL_BLOCK_ID, k)] = NULL_BLOCK_ID
    return out


class BlockTable:
    """One cache group's block table for ``max_num_reqs`` rows.

    Args:
        block_size: manager block size ``B`` (tokens per block the pool hands out).
        max_num_reqs: rows.
        max_num_blocks_per_req: manager blocks a row can hold (``cdiv(max_model_len, B)``).
        max_num_batched_tokens: tokens per step (size of the slot-mapping buffer).
        device: where ``block_table_tensor`` and ``slot_mapping`` live.
        kernel_block_size: the kernel's block size; ``B`` must be a multiple of it.
            ``None`` means ``B``.
        num_blocks_per_row, block_id_bound: optional ``[max_num_reqs]`` ``int32`` zeroed arrays
            to use as those (``MultiGroupBlockTable`` passes rows of its 2-D arrays).

    Attributes:
        block_table_np: ``[max_num_reqs, max_num_blocks_per_req]`` ``int32``, CPU; manager ids.
        num_blocks_per_row: ``[max_num_reqs]`` ``int32``, CPU; valid manager blocks per row.
        block_id_bound: ``[max_num_reqs]`` ``int32``, CPU; per row ``>=`` its largest id (0 after a clear),
            kept by every write here and by the step kernels (stage 1's compiled scan trusts it).
        kernel_block_table: ``CpuGpuBuffer`` ``[max_num_reqs, max_num_blocks_per_req * k]``
            ``int32``; kernel ids (host mirror and device tensor).
        slot_mapping: ``CpuGpuBuffer`` ``[max_num_batched_tokens]`` ``int64``.

    Raises:
        KVCacheSpecError: a non-positive size, or ``B`` not a multiple of the kernel size.
    """

    def __init__(self, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int,
                 max_num_batched_tokens: int, device: torch.device | str = "cpu",
                 kernel_block_size: int | None = None, num_blocks_per_row: np.ndarray | None = None,
                 block_id_bound: np.ndarray | None = None):
        kbs = block_size if kernel_block_size is None else kernel_block_size
        for name, v in (("block_size", block_size), ("kernel_block_size", kbs),
                        ("max_num_reqs", max_num_reqs), ("max_num_blocks_per_req", max_num_blocks_per_req),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise KVCacheSpecError(f"BlockTable: {name} must be a positive int, got {v!r}")
        if block_size % kbs:
            raise KVCacheSpecError(
                f"manager block_size {block_size} is not a multiple of kernel_block_size {kbs}: a "
                "manager block must split into whole kernel blocks; pick a kernel block size that "
                "divides the manager block size")
        self.block_size = int(block_size)
        self.kernel_block_size = int(kbs)
        self.kernel_blocks_per_block = k = self.block_size // self.kernel_block_size
        self.max_num_reqs = int(max_num_reqs)
        self.max_num_blocks_per_req = int(max_num_blocks_per_req)
        self.device = resolve_device(device)
        self.kernel_block_table = CpuGpuBuffer((max_num_reqs, max_num_blocks_per_req * k), torch.int32,
                                               self.device, fill=NULL_BLOCK_ID)
        if k == 1:
            self.block_table_np = self.kernel_block_table.np
        else:
            self.block_table_np = np.full((max_num_reqs, max_num_blocks_per_req), NULL_BLOCK_ID, np.int32)
        self._flat_np = self.block_table_np.reshape(-1)
        self.num_blocks_per_row = (np.zeros(max_num_reqs, dtype=np.int32) if num_blocks_per_row is None
                                   else num_blocks_per_row)
        self.block_id_bound = np.zeros(max_num_reqs, np.int32) if block_id_bound is None else block_id_bound
        self.slot_mapping = CpuGpuBuffer((max_num_batched_tokens,), torch.int64, self.device,
                                         fill=PAD_SLOT_ID)
        self._kernel_offsets = np.arange(k, dtype=np.int64)
        self._row_starts = np.arange(max_num_reqs, dtype=np.int64) * max_num_blocks_per_req
        """Offset of each row in the flattened manager table."""
        self._scratch_idx = np.zeros(max_num_batched_tokens, dtype=np.int64)
        self._scratch_blk = np.zeros(max_num_batched_tokens, dtype=np.int32)

    # --- writing rows -------------------------------------------------------------------
    def _write(self, rows: np.ndarray, cols: np.ndarray, ids: np.ndarray, bound: bool = True) -> None:
        """Write manager ids at ``(rows, cols)`` and their kernel expansion (``bound``: raise ``block_id_bound``)."""
        self.block_table_np[rows, cols] = ids
        if bound:
            np.maximum.at(self.block_id_bound, rows, np.asarray(ids, dtype=np.int32))
        k = self.kernel_blocks_per_block
        if k > 1:
            kcols = (cols[:, None] * k + self._kernel_offsets).reshape(-1)
            self.kernel_block_table.np[np.repeat(rows, k), kcols] = expand_to_kernel_block_ids(ids, k)

    def _check_capacity(self, row, new_len) -> None:
        if new_len > self.max_num_blocks_per_req:
            raise MetadataError(
                f"block table row {row} would hold {new_len} blocks but max_num_blocks_per_req is "
                f"{self.max_num_blocks_per_req}: a request cannot own more than "
                "cdiv(max_model_len, block_size) blocks; check the block ids sent for it")

    def write_blocks(self, rows: np.ndarray, cols: np.ndarray, block_ids: np.ndarray | None = None) -> None:
        """Write manager ids at ``(rows[i], cols[i])`` and their kernel expansion, unchecked, for
        callers that validated capacity and update ``num_blocks_per_row`` themselves (the step
        compiler's appends). ``None``: ``NULL_BLOCK_ID`` (a window's skipped blocks: no bound to raise)."""
        null = block_ids is None
        self._write(rows, cols, np.full(rows.shape[0], NULL_BLOCK_ID, np.int32) if null else block_ids, not null)

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        """Append manager ``block_ids`` after row ``row``'s current blocks.

        Raises:
            MetadataError: the row would exceed ``max_num_blocks_per_req`` (nothing changes).
        """
        n = len(block_ids)
        if n == 0:
            return
        start = int(self.num_blocks_per_row[row])
        self._check_capacity(row, start + n)
        self.block_table_np[row, start:start + n] = block_ids
        self.block_id_bound[row] = max(self.block_id_bound[row], self.block_table_np[row, start:start + n].max())
        k = self.kernel_blocks_per_block
        if k > 1:
            self.kernel_block_table.np[row, start * k:(start + n) * k] = expand_to_kernel_block_ids(block_ids, k)
        self.num_blocks_per_row[row] = start + n

    def append_rows(self, rows: np.ndarray, counts: np.ndarray, flat_block_ids: np.ndarray) -> None:
        """Batched ``append_row``: row ``rows[i]`` gets the next ``counts[i]`` ids of
        ``flat_block_ids`` (ids concatenated in ``rows`` order). ``rows`` must be distinct.

        Raises:
            MetadataError: a row would exceed ``max_num_blocks_per_req`` (nothing changes).
        """
        rows = np.asarray(rows, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        m = rows.shape[0]
        if m == 0:
            return
        starts = self.num_blocks_per_row[rows].astype(np.int64)
        ends = starts + counts
        if ends.max() > self.max_num_blocks_per_req:
            bad = int(np.argmax(ends > self.max_num_blocks_per_req))
            self._check_capacity(int(rows[bad]), int(ends[bad]))
        flat = np.asarray(flat_block_ids, dtype=np.int32)
        if flat.shape[0] == m:  # one block per row (the common decode case)
            if counts.min() == 1:
                self._write(rows, starts, flat)
                self.num_blocks_per_row[rows] = ends
                return
        _, offsets = cumsum_and_arange(counts)
        self._write(np.repeat(rows, counts), np.repeat(starts, counts) + offsets, flat)
        self.num_blocks_per_row[rows] = ends

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        """Replace row ``row``'s blocks with ``block_ids`` (a new request, or a resumed one).

        Raises:
            MetadataError: more than ``max_num_blocks_per_req`` ids (nothing changes).
        """
        self._check_capacity(row, len(block_ids))
        if self.num_blocks_per_row[row]:
            self.clear_row(row)
        self.append_row(block_ids, row)

    def fill_vacant_row(self, block_ids: np.ndarray, row: int) -> None:
        """``add_row`` for a row that holds no blocks, without the checks (the caller
        checked ``len(block_ids) <= max_num_blocks_per_req``)."""
        n = block_ids.shape[0]
        self.block_table_np[row, :n] = block_ids
        self.block_id_bound[row] = block_ids.max() if n else 0
        k = self.kernel_blocks_per_block
        if k > 1:
            self.kernel_block_table.np[row, :n * k] = expand_to_kernel_block_ids(block_ids, k)
        self.num_blocks_per_row[row] = n

    def clear_row(self, row: int) -> None:
        """Forget row ``row``'s blocks (entries back to ``NULL_BLOCK_ID``)."""
        n = int(self.num_blocks_per_row[row])
        if n:
            self.block_table_np[row, :n] = NULL_BLOCK_ID
            if self.kernel_blocks_per_block > 1:
                self.kernel_block_table.np[row, :n * self.kernel_blocks_per_block] = NULL_BLOCK_ID
            self.num_blocks_per_row[row] = self.block_id_bound[row] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row ``src`` into row ``tgt`` (``src`` is left as it was)."""
        self.move_rows(np.array([src]), np.array([tgt]))

    def move_rows(self, srcs: np.ndarray, tgts: np.ndarray) -> None:
        """Batched ``move_row``; the ``srcs`` and ``tgts`` sets must be disjoint."""
        if len(srcs) == 0:
            return
        w = int(max(self.num_blocks_per_row[srcs].max(), self.num_blocks_per_row[tgts].max()))
        if w:
            self.block_table_np[tgts, :w] = self.block_table_np[srcs, :w]
            k = self.kernel_blocks_per_block
            if k > 1:
                kt = self.kernel_block_table.np
                kt[tgts, :w * k] = kt[srcs, :w * k]
        self.num_blocks_per_row[tgts] = self.num_blocks_per_row[srcs]
        self.block_id_bound[tgts] = self.block_id_bound[srcs]

    def swap_row(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b``."""
        w = int(max(self.num_blocks_per_row[a], self.num_blocks_per_row[b]))
        ab, ba = [a, b], [b, a]
        if w:
            self.block_table_np[ab, :w] = self.block_table_np[ba, :w]
            k = self.kernel_blocks_per_block
            if k > 1:
                kt = self.kernel_block_table.np
                kt[ab, :w * k] = kt[ba, :w * k]
        self.num_blocks_per_row[ab] = self.num_blocks_per_row[ba]
        self.block_id_bound[ab] = self.block_id_bound[ba]

    # --- reading ------------------------------------------------------------------------
    def row_block_ids(self, row: int) -> list[int]:
        """Row ``row``'s manager block ids (a fresh list)."""
        return self.block_table_np[row, :self.num_blocks_per_row[row]].tolist()

    def commit(self, num_reqs: int) -> None:
        """Copy rows ``0 .. num_reqs-1`` of the kernel table host → device.

        Non-blocking from pinned memory (no host sync); nothing to do on a CPU device,
        where the device tensor is the host buffer.
        """
        self.kernel_block_table.copy_to_gpu(num_reqs)

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        """``block_table_tensor``: ``[num_reqs, max_num_blocks_per_req * k]``, ``torch.int32``,
        on the device; kernel block ids, ``NULL_BLOCK_ID`` past each row's blocks. A view
        of a persistent buffer: valid until the rows are next changed and committed."""
        return self.kernel_block_table.gpu_view(num_reqs)

    def compute_slot_mapping(self, req_indices: np.ndarray | None, positions: np.ndarray,
                             num_tokens_padded: int | None = None, *,
                             block_index: np.ndarray | None = None,
                             block_offset: np.ndarray | None = None) -> torch.Tensor:
        """Fill the slot mapping for the step's tokens and copy it to the device.

        Args:
            req_indices: ``[num_tokens]`` ``int64``, CPU: the row of each token; ``None``
                when token ``t`` belongs to row ``t`` (one token per row: a decode step).
            positions: ``[num_tokens]`` ``int64``, CPU: each token's position in its request.
                Precondition (checked by the step compiler): ``positions[t] // B <
                num_blocks_per_row[req_indices[t]]``.
            num_tokens_padded: pad the mapping to this length with ``PAD_SLOT_ID``.
            block_index, block_offset: ``positions // B`` and ``positions % B`` when the
                caller already has them (groups with equal block sizes share them).

        Returns:
            ``slot_mapping``: ``[num_tokens_padded or num_tokens]``, ``torch.int64``, on the
            device; units: flat slot index ``block_id * block_size + offset``. A view of a
            persistent buffer, valid until the next call. Non-blocking copy (no host sync).
        """
        total = self.fill_slot_mapping(req_indices, positions, num_tokens_padded, block_index=block_index,
                                       block_offset=block_offset)
        return self.slot_mapping.copy_to_gpu(total)

    def fill_slot_mapping(self, req_indices: np.ndarray | None, positions: np.ndarray,
                          num_tokens_padded: int | None = None, *, block_index: np.ndarray | None = None,
                          block_offset: np.ndarray | None = None) -> int:
        """:meth:`compute_slot_mapping` on the host buffer only (``slot_mapping.np``), no
        copy; returns the filled length (``num_tokens_padded`` or ``len(positions)``)."""
        n = int(positions.shape[0])
        B = self.block_size
        if block_index is None:
            block_index = positions // B
            block_offset = positions % B
        starts = self._row_starts[:n] if req_indices is None else self._row_starts[req_indices]
        flat_idx = np.add(starts, block_index, out=self._scratch_idx[:n])
        blocks = self._flat_np.take(flat_idx, out=self._scratch_blk[:n])
        out = self.slot_mapping.np
        np.multiply(blocks, B, out=out[:n], dtype=np.int64)
        np.add(out[:n], block_offset, out=out[:n])
        total = n if num_tokens_padded is None else int(num_tokens_padded)
        if total > n:
            out[n:total] = PAD_SLOT_ID
        return total


class MultiGroupBlockTable:
    """One :class:`BlockTable` per cache group; row operations apply to every group.

    Args:
        block_sizes: manager block size per group.
        max_num_reqs, max_model_len, max_num_batched_tokens: buffer limits; each group gets
            ``cdiv(max_model_len, block_size)`` blocks per row.
        device: where the device tensors live.
        kernel_block_sizes: kernel block size per group (``None``: same as manager).
    """

    def __init__(self, block_sizes: Sequence[int], max_num_reqs: int, max_model_len: int,
                 max_num_batched_tokens: int, device: torch.device | str = "cpu",
                 kernel_block_sizes: Sequence[int] | None = None):
        block_sizes = list(block_sizes)
        if not block_sizes:
            raise KVCacheSpecError("MultiGroupBlockTable needs at least one cache group")
        kernel_block_sizes = list(block_sizes if kernel_block_sizes is None else kernel_block_sizes)
        if len(kernel_block_sizes) != len(block_sizes):
            raise KVCacheSpecError(
                f"{len(kernel_block_sizes)} kernel block sizes for {len(block_sizes)} cache groups: "
                "give one per group")
        self.num_blocks_per_row = np.zeros((len(block_sizes), max_num_reqs), dtype=np.int32)
        """``[num_groups, max_num_reqs]`` ``int32``: row ``g`` is group ``g``'s ``num_blocks_per_row``."""
        self.block_id_bound = np.zeros((len(block_sizes), max_num_reqs), dtype=np.int32)  # the same
        self.block_tables = [
            BlockTable(bs, max_num_reqs, -(-max_model_len // bs), max_num_batched_tokens, device, kbs,
                       self.num_blocks_per_row[g], self.block_id_bound[g])
            for g, (bs, kbs) in enumerate(zip(block_sizes, kernel_block_sizes))]

    def __len__(self) -> int:
        return len(self.block_tables)

    def __getitem__(self, group: int) -> BlockTable:
        return self.block_tables[group]

    def __iter__(self):
        return iter(self.block_tables)

    def add_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        """Replace row ``row`` in every group; ``block_ids[g]`` are group ``g``'s ids."""
        for bt, ids in zip(self.block_tables, block_ids):
            bt.add_row(ids, row)

    def append_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        """Append ``block_ids[g]`` to row ``row`` of group ``g``."""
        for bt, ids in zip(self.block_tables, block_ids):
            bt.append_row(ids, row)

    def clear_rows(self, rows: list[int]) -> None:
        """``clear_row`` for each of ``rows`` in every group."""
        for bt in self.block_tables:
            for row in rows:
                bt.clear_row(row)

    def clear_row(self, row: int) -> None:
        for bt in self.block_tables:
            bt.clear_row(row)

    def move_row(self, src: int, tgt: int) -> None:
        for bt in self.block_tables:
            bt.move_row(src, tgt)

    def move_rows(self, srcs: np.ndarray, tgts: np.ndarray) -> None:
        for bt in self.block_tables:
            bt.move_rows(srcs, tgts)

    def swap_row(self, a: int, b: int) -> None:
        for bt in self.block_tables:
            bt.swap_row(a, b)

    def commit(self, num_reqs: int) -> None:
        """Commit rows ``0 .. num_reqs-1`` of every group (see :meth:`BlockTable.commit`)."""
        for bt in self.block_tables:
            bt.commit(num_reqs)
