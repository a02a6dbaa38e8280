"""``PageMetadataBuffers``: the page metadata computed into persistent buffers equals the
plain definitions (``page_metadata`` / ``gather_page_indices``, FlashInfer's documented CSR
convention) on random padded batches, whatever earlier steps left in the buffers, from
contiguous and column-sliced block tables, at the same addresses every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.backends.flashinfer import PageMetadataBuffers, gather_page_indices, page_metadata


def _naive(seq_lens, batch, table, page_size):
    lens = np.zeros(batch, dtype=np.int64)
    lens[: len(seq_lens)] = seq_lens
    indptr, last, pages = page_metadata(lens, page_size)
    return indptr, last, gather_page_indices(table, indptr, pages)


@pytest.mark.parametrize("on_device", [False, True], ids=["host-positions", "device-positions"])
def test_buffers_match_the_definition_on_random_padded_steps(on_device):
    rng = np.random.default_rng(7)
    page_size, max_reqs, width = 4, 12, 9
    bufs = PageMetadataBuffers(max_reqs, width, page_size, "cpu")
    bufs.positions_on_device = on_device  # the GPU path (repeat_interleave of 2 * B uploaded ints), on the CPU
    for step in range(40):  # sizes go up and down: stale entries of a bigger step must not leak
        n = int(rng.integers(0, max_reqs + 1))
        batch = int(rng.integers(n, max_reqs + 1))
        seq_lens = rng.integers(0 if step % 3 else 1, page_size * width + 1, size=n).astype(np.int32)
        full = torch.from_numpy(rng.integers(0, 1000, size=(max_reqs, width + 3)).astype(np.int32))
        for table in (full, full[:, :width]):  # contiguous, and a column slice of a wider table
            indptr, last, indices, total = bufs.compute(seq_lens, batch, table)
            want_ptr, want_last, want_idx = _naive(seq_lens, batch, table, page_size)
            assert indptr.tolist() == want_ptr.tolist() and last.tolist() == want_last.tolist()
            assert total == int(want_ptr[-1]) and indices.tolist() == want_idx.tolist()
            assert all(t.dtype == torch.int32 for t in (indptr, last, indices))
            for view, buf in ((indptr, bufs.indptr), (last, bufs.last_page_len), (indices, bufs.indices)):
                assert view.untyped_storage().data_ptr() == buf.data_ptr()  # a view of the persistent buffer


def test_prefill_qo_indptr_is_relative_to_the_first_prefill():
    bufs = PageMetadataBuffers(4, 2, 16, "cpu")
    qsl = np.array([0, 1, 2, 7, 12], dtype=np.int32)
    assert bufs.prefill_qo_indptr(qsl, 2).tolist() == [0, 5, 10]
    assert bufs.prefill_qo_indptr(qsl, 4).tolist() == [0]
