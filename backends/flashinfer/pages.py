"""FlashInfer's paged-KV page metadata (CSR over the block table), computed once per step.

FlashInfer's convention (its ``BatchDecodeWithPagedKVCacheWrapper.plan`` documentation):
request ``i`` owns pages ``paged_kv_indices[paged_kv_indptr[i] : paged_kv_indptr[i+1]]``
and has ``page_size * (num_pages_i - 1) + paged_kv_last_page_len[i]`` keys, with
``1 <= last_page_len <= page_size``. ``num_pages_i = cdiv(seq_lens[i], page_size)``: the
first ``num_pages_i`` block-table entries of the row, in order.

:func:`page_metadata` and :func:`gather_page_indices` are the plain definitions (fresh
arrays); :class:`PageMetadataBuffers` computes the same values into persistent buffers,
vectorised (no per-request Python loop), reading only the block-table entries the step
needs (at most ``cdiv(max_seq_len, page_size)`` columns of each row, never the table's
full width).
"""

from __future__ import annotations

import numpy as np
import torch

from attnplug.cache_groups.buffers import upload


def page_metadata(seq_lens: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's per-request page counts as CSR arrays, vectorized.

    Args:
        seq_lens: ``[B]`` int, keys per request (0 for padded requests).
        page_size: tokens per page.

    Returns:
        ``(indptr [B + 1], last_page_len [B], num_pages [B])``, int32: request ``i`` owns
        ``num_pages[i] = cdiv(seq_lens[i], page_size)`` pages and ``page_size *
        (num_pages - 1) + last_page_len == seq_lens`` whenever it owns any;
        ``1 <= last_page_len <= page_size`` always.

    Examples:
        >>> ptr, last, n = page_metadata(np.array([5, 16, 1, 0]), 4)
        >>> ptr.tolist(), last.tolist(), n.tolist()
        ([0, 2, 6, 7, 7], [1, 4, 1, 4], [2, 4, 1, 0])
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    num_pages = (lens + page_size - 1) // page_size
    indptr = np.zeros(lens.shape[0] + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    last_page_len = (lens - 1) % page_size + 1
    return indptr, last_page_len.astype(np.int32), num_pages.astype(np.int32)


def gather_page_indices(block_table: torch.Tensor, indptr: np.ndarray, num_pages: np.ndarray) -> torch.Tensor:
    """``paged_kv_indices``: each request's first ``num_pages`` block-table entries, in order.

    Args:
        block_table: ``[>= B, max_num_blocks_per_req]``, ``torch.int32``, device.
        indptr, num_pages: from :func:`page_metadata` (``[B + 1]``, ``[B]``).

    Returns:
        ``[indptr[B]]``, ``torch.int32``, on ``block_table``'s device (a new tensor).
    """
    B = num_pages.shape[0]
    total = int(indptr[B])
    rows = np.repeat(np.arange(B, dtype=np.int64), num_pages)
    cols = np.arange(total, dtype=np.int64) - indptr[:B].astype(np.int64)[rows]
    dev = block_table.device
    rows_t, cols_t = upload(np.stack([rows, cols]), dev)  # one pinned copy (a pageable one would sync)
    return block_table[rows_t, cols_t].to(torch.int32)


class PageMetadataBuffers:
    """Persistent buffers for one builder's page metadata, rewritten by every :meth:`compute`.

    ``PageMetadataBuffers(max_num_reqs, max_num_blocks_per_req, page_size, device)``.
    Host (CPU, pageable) int32 ``indptr [max_num_reqs + 1]``, ``last_page_len
    [max_num_reqs]``, ``qo_indptr [max_num_reqs + 1]``, an int64 scratch of flat
    block-table positions, and the int32 ``indices [max_num_reqs * max_num_blocks_per_req]``
    on ``device``. The views :meth:`compute` returns are valid until its next call (a
    builder's next build). The host buffers are pageable, not pinned, so a device copy
    from them (FlashInfer's ``plan()`` copies ``indptr`` / ``last_page_len``; this class
    copies the positions) has left them when the copy call returns, and the next step may
    overwrite them at once.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, page_size: int, device: torch.device):
        self.page_size = int(page_size)
        self.device = torch.device(device)
        n, cap = max_num_reqs, max_num_reqs * max_num_blocks_per_req
        self.indptr = torch.zeros(n + 1, dtype=torch.int32)
        self.last_page_len = torch.full((n,), self.page_size, dtype=torch.int32)
        self.qo_indptr = torch.zeros(n + 1, dtype=torch.int32)
        self._num_pages = np.zeros(n, dtype=np.int32)
        self._positions = torch.zeros(cap, dtype=torch.int64)  # host positions (CPU path)
        self._arange = np.arange(cap, dtype=np.int64)
        self.indices = torch.zeros(cap, dtype=torch.int32, device=self.device)
        self.positions_on_device = self.device.type != "cpu"
        """Expand the flat positions on the device from ``2 * B`` uploaded ints (a GPU), or
        on the host (a CPU); the result is the same (tests force either path)."""
        self._row_pages = torch.zeros((2, n), dtype=torch.int64)
        self._row_pages_dev = torch.zeros((2, n), dtype=torch.int64, device=self.device)
        self._arange_dev = (torch.from_numpy(self._arange) if self.device.type == "cpu"
                            else torch.arange(cap, dtype=torch.int64, device=self.device))
        self._np = (self.indptr.numpy(), self.last_page_len.numpy(), self.qo_indptr.numpy(), self._positions.numpy())

    def compute(self, seq_lens: np.ndarray, batch: int, block_table: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The step's CSR page metadata, written into the buffers.

        Args:
            seq_lens: ``[n]`` int (host), keys of the real requests; rows ``n .. batch - 1``
                are padding and own no page.
            batch: ``B >= n``, the rows the metadata covers.
            block_table: ``[>= B, >= cdiv(max(seq_lens), page_size)]`` int32 on the
                buffers' device (checked by the builder).

        Returns:
            ``(indptr [B + 1], last_page_len [B], indices [total], total)``: views of the
            buffers (CPU, CPU, device). Only the ``total`` block-table entries the pages
            need are read: one vectorised pass over the ``B`` rows on the host and one
            gather on the device (``index_select`` into the persistent ``indices``).
        """
        indptr, last = self._np[0], self._np[1]
        n, ps = seq_lens.shape[0], self.page_size
        pages = self._num_pages[:batch]
        np.add(seq_lens, ps - 1, out=pages[:n])
        np.floor_divide(pages[:n], ps, out=pages[:n])
        pages[n:] = 0
        np.cumsum(pages, out=indptr[1: batch + 1])
        np.subtract(seq_lens, 1, out=last[:n])
        np.remainder(last[:n], ps, out=last[:n])
        last[:n] += 1
        last[n:batch] = ps
        total = int(indptr[batch])
        indices = self.indices[:total]
        if total:
            table = block_table
            if not table.is_contiguous():  # a column slice: copy the live columns only
                table = table[:batch, : int(pages.max())].contiguous()
            torch.index_select(table.view(-1), 0, self._positions_of(pages, batch, table.shape[1], total),
                               out=indices)
        return self.indptr[: batch + 1], self.last_page_len[:batch], indices, total

    def _positions_of(self, pages: np.ndarray, batch: int, width: int, total: int) -> torch.Tensor:
        """``[total]`` int64 flat block-table positions of every page, on the device: entry
        ``j`` of request ``i``'s pages sits at ``i * width + j``, i.e. at ``k + i * width -
        indptr[i]`` for its ``k``-th page overall."""
        row_base = self._row_pages.numpy()
        np.multiply(self._arange[:batch], width, out=row_base[0, :batch])
        row_base[0, :batch] -= self._np[0][:batch]
        if not self.positions_on_device:
            pos = self._np[3][:total]
            np.add(self._arange[:total], np.repeat(row_base[0, :batch], pages), out=pos)
            return self._positions[:total]
        row_base[1, :batch] = pages
        dev = self._row_pages_dev[:, :batch]
        dev.copy_(self._row_pages[:, :batch])  # 2 * B ints up (pageable: the host buffer is free at return)
        expanded = torch.repeat_interleave(dev[0], dev[1], output_size=total)  # output_size: no host sync
        return expanded.add_(self._arange_dev[:total])

    def prefill_qo_indptr(self, query_start_loc: np.ndarray, num_decodes: int) -> torch.Tensor:
        """``qo_indptr`` of the prefill slice: ``query_start_loc[num_decodes:] -
        query_start_loc[num_decodes]`` (int32, CPU view of the persistent buffer)."""
        qo = self._np[2]
        k = query_start_loc.shape[0] - num_decodes
        np.subtract(query_start_loc[num_decodes:], query_start_loc[num_decodes], out=qo[:k])
        return self.qo_indptr[:k]
